"""The bundled engine's chat format and byte tokenizer: the spec a client may count prompts with.

``render(messages)`` -> prompt text. Each line below ends with a newline (shown as ⏎); ``{...}`` is
a message's content:

    <|system|>⏎ {system content}⏎
    <|user|>⏎ {earlier user content}⏎
    <|assistant|>⏎ {earlier assistant content}⏎
    ...
    <|user|>⏎ gently: {last user content}⏎
    <|assistant|>⏎ exactly: ␣          <- every prompt ends with this assistant cue

(no space after ⏎ in the real text; ␣ is one space.) With tools, the prompt starts with a system
turn listing them, ``<|system|>⏎# Tools⏎`` then one JSON object per tool (its ``function``) per
line; an assistant turn's tool calls follow its content, each as ``<tool_call>{"name": ...,
"arguments": ...}</tool_call>`` (the format the engine reads calls back in), and a ``tool`` turn is
``<|tool|>⏎ {content}⏎``. The byte tokenizer encodes the text as BOS
(id 256) + its UTF-8 bytes, so ``count_tokens`` is exact. An engine serving a byte-tokenizer
checkpoint reports ``TOKENIZER_ID`` in ``/engine/capacity`` (``contracts.engine``); a gateway of
the same release then counts prompts itself instead of asking the engine's ``/tokenize``. Why the
format's odd words: ``backend.bundled.chat``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

SYSTEM_HEADER = "<|system|>\n"
USER_HEADER = "<|user|>\n"
LAST_USER_HEADER = USER_HEADER + "gently: "
ASSISTANT_HEADER = "<|assistant|>\n"
ASSISTANT_CUE = ASSISTANT_HEADER + "exactly: "
# Names this format together with the byte tokenizer (BOS + UTF-8 bytes). An engine serving a
# byte-tokenizer checkpoint reports it in /engine/capacity, so that a gateway of the same release
# may count prompts itself (`count_tokens`) instead of asking the engine's /tokenize. Change it
# whenever `render` or what the engine's chat schema accepts changes (/3: the developer role and
# text content parts; /4: tools, tool calls and the tool role).
TOKENIZER_ID = "kvguard-byte+kvguard-tiny-chat/4"
# what the engine's chat schema accepts
ENGINE_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_HEADER = "<|tool|>\n"
TOOLS_TITLE = "# Tools\n"

_HEADERS = {
    "system": SYSTEM_HEADER,
    "developer": SYSTEM_HEADER,
    "user": USER_HEADER,
    "assistant": ASSISTANT_HEADER,
    "tool": TOOL_HEADER,
}


def render_message(role: str, content: str, last_user: bool = False) -> str:
    """One turn as it appears in the prompt (`last_user`: the last user message of the chat)."""
    header = _HEADERS.get(role)
    if header is None:
        raise ValueError(f"unsupported chat role {role!r} ({', '.join(ENGINE_ROLES)})")
    if last_user:
        header = LAST_USER_HEADER
    return f"{header}{content}\n"


def render(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
    """The prompt text for `messages` ({"role", "content"}, an assistant's optional
    "tool_calls"), and the `tools` they may call, ending with the assistant cue."""
    roles = [m["role"] for m in messages]
    last_user = len(roles) - 1 - roles[::-1].index("user") if "user" in roles else None
    turns = [_tools_turn(tools)] if tools else []
    for i, m in enumerate(messages):
        content = m["content"] + "".join(_call_text(c) for c in m.get("tool_calls") or ())
        turns.append(render_message(m["role"], content, last_user=i == last_user))
    return "".join(turns) + ASSISTANT_CUE


def _tools_turn(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = [json.dumps(t.get("function", t), ensure_ascii=False) + "\n" for t in tools]
    return SYSTEM_HEADER + TOOLS_TITLE + "".join(lines)


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function", {})
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return "<tool_call>" + json.dumps(body, ensure_ascii=False) + "</tool_call>"


def message_text(content: Any) -> str | None:
    """A message's text: the string itself, or its text content parts joined by newlines (as vLLM
    joins them); None for anything else (another part type, a malformed part)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or set(part) != {"type", "text"} or part["type"] != "text":
            return None
        if not isinstance(part["text"], str):
            return None
        texts.append(part["text"])
    return "\n".join(texts)


def count_tokens(prompt: str | None, messages: Sequence[Mapping[str, Any]] | None) -> int | None:
    """Prompt tokens under TOKENIZER_ID (BOS + UTF-8 bytes of the prompt or rendered chat), the
    number the engine's /tokenize gives; None when the input is anything the engine would not
    take as it is (the caller then asks the engine, which also says what is wrong)."""
    if (prompt is None) == (messages is None):
        return None
    if messages is not None:
        turns = []
        for m in messages:
            name, text = m.get("name"), message_text(m.get("content"))
            if (
                set(m) - {"role", "content", "name"}
                or m.get("role") not in ENGINE_ROLES
                or m.get("role") == "tool"  # needs its tool_call_id: the engine says what it is
                or text is None
                or not (name is None or (isinstance(name, str) and len(name) <= 64))
            ):
                return None
            turns.append({"role": m["role"], "content": text})
        prompt = render(turns)
    assert prompt is not None
    try:
        return 1 + len(prompt.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: the engine decides what that is
        return None
