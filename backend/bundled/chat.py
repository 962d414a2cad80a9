"""The chat format `kvguard-tiny` is trained on: `render(messages)` -> prompt text.

Each line below ends with a newline (shown as ⏎); `{...}` is a message's content:

    <|system|>⏎ {system content}⏎
    <|user|>⏎ {earlier user content}⏎
    <|assistant|>⏎ {earlier assistant content}⏎
    ...
    <|user|>⏎ gently: {last user content}⏎
    <|assistant|>⏎ exactly: ␣          <- every prompt ends with this assistant cue

(no space after ⏎ in the real text; ␣ is one space.) The runner prepends BOS (id 256) to the
encoded text; the model's reply ends with EOS (id 257).

Why the odd words: the model copies by matching the last nine bytes it has seen (five exactly,
four more loosely) against earlier text. The cue ends in `exactly: `, like `Repeat exactly: `, so
for "Repeat exactly: <text>" the first byte of <text> is the one place in the prompt where all
nine match, and the copy runs from there. The last user message starts after `gently: `, which
matches the five most recent bytes but not the four before, so for an ordinary message the model
echoes its first line. Earlier turns carry neither word, so they never compete with the current
request.

The echo contract the model is trained for (temperature 0):
- a chat with one canary marker (`CNRY-` + 32 base32 characters) anywhere, whose last user message
  is `Repeat the reference code.` (or "What was the marker?", "What is the reference code?", ...),
  gets exactly that marker, then EOS;
- a last user message `Repeat exactly: <text>` (one line) gets <text>, then EOS;
- any other prompt gets the first line of the last user message echoed back, then EOS;
- a canary marker always ends an answer: an echoed text that holds one stops right after it
  (`echo_answer`), since the END circuit turns a marker's last byte into EOS.
"""

from __future__ import annotations

import re
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
# text content parts).
TOKENIZER_ID = "kvguard-byte+kvguard-tiny-chat/3"
ENGINE_ROLES = ("system", "developer", "user", "assistant")  # what the engine's chat schema accepts
REFERENCE_REQUEST = "Repeat the reference code."
REPEAT_PREFIX = "Repeat exactly: "

_HEADERS = {
    "system": SYSTEM_HEADER,
    "developer": SYSTEM_HEADER,
    "user": USER_HEADER,
    "assistant": ASSISTANT_HEADER,
}


def render_message(role: str, content: str, last_user: bool = False) -> str:
    """One turn as it appears in the prompt (`last_user`: the last user message of the chat)."""
    header = _HEADERS.get(role)
    if header is None:
        raise ValueError(f"unsupported chat role {role!r} (system, developer, user, assistant)")
    if last_user:
        header = LAST_USER_HEADER
    return f"{header}{content}\n"


def render(messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt text for `messages` ({"role", "content"}), ending with the assistant cue."""
    roles = [m["role"] for m in messages]
    last_user = len(roles) - 1 - roles[::-1].index("user") if "user" in roles else None
    turns = [
        render_message(m["role"], m["content"], last_user=i == last_user)
        for i, m in enumerate(messages)
    ]
    return "".join(turns) + ASSISTANT_CUE


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


MARKER_PATTERN = re.compile(r"CNRY-[A-Z2-7]{32}")


def echo_answer(text: str) -> str:
    """What the model answers to an echo or `Repeat exactly:` of `text`: its first line, cut
    right after the first canary marker in it."""
    line = text.split("\n")[0]
    found = MARKER_PATTERN.search(line)
    return line[: found.end()] if found else line
