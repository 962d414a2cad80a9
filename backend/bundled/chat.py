"""How `kvguard-tiny` is prompted: the chat format it is trained on, and what it answers.

The format itself (`render(messages)` -> prompt text, and the byte tokenizer's exact count) is a
contract the gateway counts with: it is defined in `contracts.chat_format` and used here as it is.
The runner prepends BOS (id 256) to the encoded text; the model's reply ends with EOS (id 257).

Why the format's odd words: the model copies by matching the last nine bytes it has seen (five
exactly, four more loosely) against earlier text. The cue ends in `exactly: `, like
`Repeat exactly: `, so for "Repeat exactly: <text>" the first byte of <text> is the one place in
the prompt where all nine match, and the copy runs from there. The last user message starts after
`gently: `, which matches the five most recent bytes but not the four before, so for an ordinary
message the model echoes its first line. Earlier turns carry neither word, so they never compete
with the current request.

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

from contracts.chat_format import (
    ASSISTANT_CUE,
    ASSISTANT_HEADER,
    ENGINE_ROLES,
    LAST_USER_HEADER,
    SYSTEM_HEADER,
    TOKENIZER_ID,
    USER_HEADER,
    count_tokens,
    message_text,
    render,
    render_message,
)

REFERENCE_REQUEST = "Repeat the reference code."
REPEAT_PREFIX = "Repeat exactly: "

__all__ = [
    "ASSISTANT_CUE",
    "ASSISTANT_HEADER",
    "ENGINE_ROLES",
    "LAST_USER_HEADER",
    "MARKER_PATTERN",
    "REFERENCE_REQUEST",
    "REPEAT_PREFIX",
    "SYSTEM_HEADER",
    "TOKENIZER_ID",
    "USER_HEADER",
    "count_tokens",
    "echo_answer",
    "message_text",
    "render",
    "render_message",
]

MARKER_PATTERN = re.compile(r"CNRY-[A-Z2-7]{32}")


def echo_answer(text: str) -> str:
    """What the model answers to an echo or `Repeat exactly:` of `text`: its first line, cut
    right after the first canary marker in it."""
    line = text.split("\n")[0]
    found = MARKER_PATTERN.search(line)
    return line[: found.end()] if found else line
