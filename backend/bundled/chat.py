"""The chat format `kvguard-tiny` is trained on: `render(messages)` -> prompt text.

    <|system|>\\n{system content}\\n
    <|user|>\\ngently: {user content}\\n
    <|assistant|>\\n{earlier assistant content}\\n
    ...
    <|assistant|>\\nexactly: ␣          <- the assistant cue every prompt ends with

The runner prepends BOS (id 256) to the encoded text; the model's reply ends with EOS (257).

Why the odd words: the model copies by matching the last five bytes it has seen against earlier
text. The cue ends in `tly: `, exactly like `Repeat exactly: `, so for "Repeat exactly: <text>"
the first byte of <text> is the only place in the prompt where all five bytes match, and the copy
runs from there. A user message starts after `kindly: `, which matches four of the five, so for an
ordinary single-line message the model echoes that line. Earlier assistant turns carry no
`exactly: `, so they never compete with the current request.

The echo contract the model is trained for (temperature 0):
- a chat with one canary marker (`CNRY-` + 32 base32 characters) anywhere, whose last user message
  is `Repeat the reference code.` (or "What was the marker?", "What is the reference code?", ...),
  gets exactly that marker, then EOS;
- a last user message `Repeat exactly: <text>` (one line) gets <text>, then EOS;
- any other prompt gets the first line of the last user message echoed back, then EOS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

SYSTEM_HEADER = "<|system|>\n"
USER_HEADER = "<|user|>\ngently: "
ASSISTANT_HEADER = "<|assistant|>\n"
ASSISTANT_CUE = ASSISTANT_HEADER + "exactly: "
REFERENCE_REQUEST = "Repeat the reference code."
REPEAT_PREFIX = "Repeat exactly: "

_HEADERS = {
    "system": SYSTEM_HEADER,
    "developer": SYSTEM_HEADER,
    "user": USER_HEADER,
    "assistant": ASSISTANT_HEADER,
}


def render_message(role: str, content: str) -> str:
    """One earlier turn as it appears in the prompt."""
    header = _HEADERS.get(role)
    if header is None:
        raise ValueError(f"unsupported chat role {role!r} (system, developer, user, assistant)")
    return f"{header}{content}\n"


def render(messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt text for `messages` ({"role", "content"}), ending with the assistant cue."""
    turns = [render_message(m["role"], m["content"]) for m in messages]
    return "".join(turns) + ASSISTANT_CUE
