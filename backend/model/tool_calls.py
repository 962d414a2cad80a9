"""How a checkpoint family writes tool calls in its text, and reading them back out.

Three formats cover the families this engine serves (shapes as the families' own chat templates
write them, and as vLLM's ``hermes``, ``llama3_json`` and ``mistral`` parsers read them):

- ``hermes`` (Qwen2, Qwen3, Hermes, and the bundled model): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (whitespace around the JSON
  allowed); text before the first call is the message's content;
- ``llama3_json`` (Llama 3.1+): the whole answer is one or more ``{"name": ..., "parameters":
  {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``;
  text before it is the content.

The format of a checkpoint is read from its chat template (``detect``): a template that writes
``<tool_call>`` is hermes, one with ``[TOOL_CALLS]`` or ``[AVAILABLE_TOOLS]`` mistral, one with
``<|python_tag|>`` or Llama 3's headers llama3_json; none of these: hermes (the widest-used).

``parse(text)`` never drops text: an answer that does not read completely as calls in the format
(unbalanced tags, invalid JSON, a call without a string name or an object of arguments) comes back
as content, whole, with no calls. Pure: no torch, no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str = field(repr=False)  # JSON text of an object


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # None: no text besides the calls
    calls: tuple[ParsedCall, ...]


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    name: str
    # where calls start: text after it is calls (None: the answer itself must be all calls)
    trigger: str | None
    arguments_key: str  # "arguments" or "parameters"
    # special tokens whose text must reach the parser (decode would drop it)
    kept_specials: tuple[str, ...] = ()

    def parse(self, text: str) -> ParsedOutput:
        calls = _PARSERS[self.name](self, text)
        if calls is None:
            return ParsedOutput(text, ())
        content, found = calls
        return ParsedOutput(content or None, found)

    def may_start_call(self, text: str) -> int:
        """Where in ``text`` a call may be starting (the trigger, or a prefix of it at the
        end); ``len(text)`` when nowhere. A streamed answer releases text only before it."""
        if self.trigger is None:
            stripped = text.lstrip()
            head = stripped[: len(_PYTHON_TAG)]
            if stripped.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
                return len(text) - len(stripped)
            return len(text)
        at = text.find(self.trigger)
        if at >= 0:
            return at
        for cut in range(min(len(self.trigger) - 1, len(text)), 0, -1):
            if self.trigger.startswith(text[-cut:]):
                return len(text) - cut
        return len(text)


_PYTHON_TAG = "<|python_tag|>"
HERMES = ToolCallFormat("hermes", "<tool_call>", "arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", None, "parameters", (_PYTHON_TAG,))
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", "arguments", ("[TOOL_CALLS]",))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def detect(template_text: str) -> ToolCallFormat:
    """The format a chat template writes tool calls in (see the module docstring)."""
    if "<tool_call>" in template_text:
        return HERMES
    if "[TOOL_CALLS]" in template_text or "[AVAILABLE_TOOLS]" in template_text:
        return MISTRAL
    if _PYTHON_TAG in template_text or "<|start_header_id|>" in template_text:
        return LLAMA3_JSON
    return HERMES


def _call(raw: Any, key: str) -> ParsedCall | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        return None
    arguments = raw.get(key, raw.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(raw["name"], json.dumps(arguments, ensure_ascii=False))


def _hermes(fmt: ToolCallFormat, text: str) -> tuple[str, tuple[ParsedCall, ...]] | None:
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls = []
    rest = text[start:]
    for match in re.finditer(r"<tool_call>(.*?)</tool_call>|(\S)", rest, re.DOTALL):
        if match.group(2) is not None:  # text after or between calls: not only calls
            return None
        call = _call(_loads(match.group(1)), fmt.arguments_key)
        if call is None:
            return None
        calls.append(call)
    return text[:start].rstrip(), tuple(calls)


def _llama3(fmt: ToolCallFormat, text: str) -> tuple[str, tuple[ParsedCall, ...]] | None:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            raw, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        call = _call(raw, fmt.arguments_key)
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return "", tuple(calls)


def _mistral(fmt: ToolCallFormat, text: str) -> tuple[str, tuple[ParsedCall, ...]] | None:
    assert fmt.trigger is not None
    start = text.find(fmt.trigger)
    if start < 0:
        return None
    raw = _loads(text[start + len(fmt.trigger) :])
    items = raw if isinstance(raw, list) else [raw]
    calls = [_call(item, fmt.arguments_key) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return text[:start].rstrip(), tuple(c for c in calls if c is not None)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}
