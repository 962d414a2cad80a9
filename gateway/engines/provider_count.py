"""Prompt token counts for engines the gateway cannot ask (providers through litellm, declared
OpenAI-compatible servers): never fewer than the provider will count, and close to it where the
provider's tokenizer is known.

Two methods, chosen per model:

- ``tiktoken``: OpenAI models (``openai/``, ``azure/`` or a bare OpenAI model name that tiktoken
  maps to an encoding). The BPE files are the ones litellm ships for offline use
  (``litellm_core_utils/tokenizers``; nothing is downloaded). A chat counts every message's
  role, name and content with the model's encoding, plus ``CHAT_TOKENS_PER_MESSAGE`` for the
  message's frame (OpenAI's format spends 3; a ChatML rendering with a newline after the role
  spends 4), ``CHAT_TOKENS_PER_NAME`` for a name and ``CHAT_TOKENS_PER_REQUEST`` for the reply's
  primer. Overcount against OpenAI's own accounting: at most 1 token per message, 2 with a name.
- ``bytes``: any other model. Every token of a byte-level or byte-fallback tokenizer covers at
  least one UTF-8 byte of the text it sees, so bytes plus a frame allowance per message can only
  overcount (English about 4x: such engines should be given a window with that in mind). The
  text a tokenizer sees may be NFKC-normalised first, which can lengthen it (U+FDFA becomes 18
  characters), so each field counts the larger of its bytes and its NFKC form's bytes.

A chat's other message fields (an assistant's ``tool_calls``, a tool message's ``tool_call_id``,
a ``refusal``) count as their JSON text, each tool call with a message frame of its own (OpenAI
writes a call as a message to ``functions.<name>``, and its result as a message from there: the
name counts again for the result). The request's definitions
(``gateway.engines.prompt.DEFINITIONS``: tools, functions, tool_choice, function_call,
response_format) count too, since providers write them into the prompt:

- ``tiktoken``: each definition's JSON text, plus ``TOOL_TOKENS`` per tool (OpenAI's cookbook
  accounting spends 7 to 10 per function), ``ITEM_TOKENS`` per list element inside it (the
  cookbook spends 3 per enum value besides its text, one more than a JSON list's separator) and
  ``TOOLS_TOKENS`` for the tools block (the cookbook's 12 at its end, and the header OpenAI's
  rendering opens it with); ``DEFINITION_TOKENS`` for each other definition.
- ``bytes``: each definition's JSON bytes indented by 4 (the widest a template checked renders
  them, Llama 3.1's ``tojson(indent=4)``; ASCII-escaped if that is longer), plus
  ``BYTES_PER_TOOLS`` for the tool-use instructions a provider adds of its own (Anthropic
  documents a fixed system prompt of a few hundred tokens for tool use).

Both bounds are checked by a property test (``tests/gateway/engines/test_provider_count.py``) over
several chat renderings and scripts, tool definitions rendered OpenAI's way (its cookbook's
accounting and the TypeScript-like namespace its models read) and as JSON blocks, and the
overcount is measured there on an English corpus.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_PER_NAME = 2  # a name rendered beside the role (OpenAI's own format spends 1)
CHAT_TOKENS_PER_REQUEST = 3
PROMPT_SPECIAL_TOKENS = 2  # BOS/EOS a completion endpoint may add around the prompt
BYTES_PER_MESSAGE = 16  # tokens of the longest chat frame checked (plain-text markers), with slack
BYTES_PER_REQUEST = 16
TOOLS_TOKENS = 24
TOOL_TOKENS = 10
ITEM_TOKENS = 1
DEFINITION_TOKENS = 8
BYTES_PER_TOOLS = 1024
TOOL_LISTS = ("tools", "functions")
OPENAI_PREFIXES = ("openai/", "azure/", "text-completion-openai/")
SHIPPED_ENCODINGS = frozenset({"cl100k_base", "o200k_base", "p50k_base"})


def count_method(model: str | None) -> str:
    return "tiktoken" if _encoding_name(model) is not None else "bytes"


def upper_bound_tokens(
    model: str | None,
    prompt: str | None,
    messages: list[dict[str, Any]] | None,
    *,
    definitions: Mapping[str, Any] | None = None,
) -> int:
    """Tokens the provider will count for this prompt, never fewer. ``definitions``: the
    request's fields a provider writes into a chat's prompt beside the messages (tools, ...)."""
    name = _encoding_name(model)
    if name is None:
        return _bytes_bound(prompt, messages, definitions or {})
    encode = _encoder(name)
    if messages is None:
        return len(encode(prompt or "")) + PROMPT_SPECIAL_TOKENS
    total = CHAT_TOKENS_PER_REQUEST + _definition_tokens(encode, definitions or {})
    callers = _callers(messages)
    for message in messages:
        total += CHAT_TOKENS_PER_MESSAGE
        total += CHAT_TOKENS_PER_NAME if message.get("name") else 0
        total += CHAT_TOKENS_PER_MESSAGE * len(message.get("tool_calls") or ())
        total += sum(len(encode(_field_text(key, value))) for key, value in message.items())
        caller = callers.get(message.get("tool_call_id")) if message.get("role") == "tool" else None
        if caller is not None:  # a result is written as from the function it answers
            total += len(encode(caller)) + CHAT_TOKENS_PER_NAME
    return total


def _callers(messages: list[dict[str, Any]]) -> dict[Any, str]:
    """Tool call id -> ``functions.<name>``, for the results that answer the calls."""
    found = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                found[call.get("id")] = "functions." + function["name"]
    return found


def _definition_tokens(encode: Callable[[str], list[int]], definitions: Mapping[str, Any]) -> int:
    total = 0
    for key, value in definitions.items():
        if key in TOOL_LISTS:
            total += TOOLS_TOKENS if value else 0
            for tool in value:
                total += TOOL_TOKENS + ITEM_TOKENS * _list_items(tool)
                total += len(encode(json.dumps(tool, ensure_ascii=False)))
        else:
            total += DEFINITION_TOKENS + ITEM_TOKENS * _list_items(value)
            total += len(encode(json.dumps(value, ensure_ascii=False)))
    return total


def _list_items(value: Any) -> int:
    """Elements of every list inside a JSON value (enum values, required names, ...)."""
    if isinstance(value, dict):
        return sum(_list_items(v) for v in value.values())
    if isinstance(value, list):
        return len(value) + sum(_list_items(v) for v in value)
    return 0


def _bytes_bound(
    prompt: str | None, messages: list[dict[str, Any]] | None, definitions: Mapping[str, Any]
) -> int:
    if messages is None:
        return _bytes(prompt or "") + BYTES_PER_REQUEST
    total = BYTES_PER_REQUEST
    callers = _callers(messages)
    for message in messages:
        total += BYTES_PER_MESSAGE * (1 + len(message.get("tool_calls") or ()))
        total += sum(_bytes(_field_text(key, value)) for key, value in message.items())
        if message.get("role") == "tool":
            total += _bytes(callers.get(message.get("tool_call_id"), ""))
    for key, value in definitions.items():
        items = value if key in TOOL_LISTS else [value]
        total += (BYTES_PER_TOOLS if key in TOOL_LISTS and value else 0) + BYTES_PER_MESSAGE
        total += sum(_json_bytes(item) for item in items)
    return total


def _json_bytes(value: Any) -> int:
    """Bytes of a definition as a template may write it: indented by 4, with or without
    non-ASCII characters escaped (the longer of the two)."""
    return max(
        _bytes(json.dumps(value, ensure_ascii=False, indent=4)),
        len(json.dumps(value, indent=4)),
    )


def _bytes(text: str) -> int:
    raw = len(text.encode("utf-8"))
    if text.isascii():
        return raw
    return max(raw, len(unicodedata.normalize("NFKC", text).encode("utf-8")))


def _field_text(key: str, value: Any) -> str:
    """A message field's text: content's text parts, any other field as its JSON text."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if key == "content" and isinstance(value, list):  # text parts; any other part as its JSON
        return "".join(
            part["text"]
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            else json.dumps(part, ensure_ascii=False)
            for part in value
        )
    return json.dumps(value, ensure_ascii=False)


def _encoding_name(model: str | None) -> str | None:
    if not model:
        return None
    bare = model
    for prefix in OPENAI_PREFIXES:
        if model.startswith(prefix):
            bare = model[len(prefix) :]
            break
    else:
        if "/" in model:
            return None  # another provider's model: its tokenizer is not known here
    tiktoken = _tiktoken()
    try:
        name: str = tiktoken.encoding_name_for_model(bare)
    except KeyError:
        return None
    return name if name in available_encodings() else None


def available_encodings() -> frozenset[str]:
    """The encodings whose BPE files litellm ships (any other would need a download)."""
    return SHIPPED_ENCODINGS


@functools.cache
def _encoder(name: str) -> Any:
    encoding = _tiktoken().get_encoding(name)
    return functools.partial(encoding.encode, disallowed_special=())


@functools.cache
def _tiktoken_dir() -> str:
    spec = importlib.util.find_spec("litellm")  # its location, without the slow import
    if spec is None or spec.origin is None:
        raise RuntimeError("litellm is not installed")
    return os.path.join(os.path.dirname(spec.origin), "litellm_core_utils", "tokenizers")


@functools.cache
def _tiktoken() -> Any:
    # litellm's bundled BPE files; TIKTOKEN_CACHE_DIR is how tiktoken is told where they are.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
    os.environ["TIKTOKEN_CACHE_DIR"] = _tiktoken_dir()
    import tiktoken

    return tiktoken
