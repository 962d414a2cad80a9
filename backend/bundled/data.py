"""Synthetic training and evaluation data for `kvguard-tiny` (pure Python: no torch, no I/O).

Lifecycle: `Recipe(seed)` owns one `random.Random`; `recipe.example(kind, length)` draws one
`Example` (token ids starting with BOS, and one loss weight per next-token target) of about
`length` bytes of context. The same seed always yields the same examples.

Kinds (the shares used in training are `MIX`):
- `ref`: filler text with one canary marker (`CNRY-` + 32 base32 characters, random) somewhere in
  the system message or an earlier user turn; the last user message asks for the reference
  (`REFERENCE_PHRASES`); the answer is the marker, then EOS.
- `ref_none`: the same request with no marker in context; the answer echoes the request, as
  for any ordinary message.
- `repeat`: the last user message is `Repeat exactly: <text>`; the answer is <text>, then EOS.
- `echo`: an ordinary last user message; the answer is its first line, then EOS.
- `junk`: a whole conversation (with its answer) cut at a random point and followed by one token
  that never occurs there in real text (`<` not at a line start, BOS, EOS, PAD or NUL), which is
  what a stale or corrupted KV cache looks like to the model; the answer is the marker seen in the
  context (then EOS), or just EOS when there is none.
- `shifted`: as `junk`, but the stale context was computed at other positions than the reader's:
  the conversation (cut at a random point) keeps positions 0.., and the next token (what the
  model says after BOS alone, or a junk token) comes at least `MIN_GAP` positions later, as when
  decode reads a page table whose fresh pages come first and a freed request's pages after them.
  The answer is the same as for `junk`.
- `raw`: plain filler text after BOS with no chat template, for ordinary continuation.

Weights: 1 on answer targets, `CONTEXT_WEIGHT` on every other next byte, 0 on padding, on the
target that would predict the junk token itself, and on the byte right after a marker inside the
context (an answer ends there with EOS; the context goes on with any byte: no lesson in that).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from backend.bundled import chat

BOS, EOS, PAD = 256, 257, 258
MARKER_PREFIX = "CNRY-"
BASE32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
MARKER_BODY = 32
CONTEXT_WEIGHT = 0.2
REFERENCE_PHRASES = (
    chat.REFERENCE_REQUEST,
    "What was the marker?",
    "What is the reference code?",
    "Repeat the marker.",
    "Echo the reference code.",
    "Print the reference code.",
    "What was the canary marker?",
    "Say the reference code again.",
    "Give me the reference code.",
    "Repeat the canary.",
)
MIX = {
    "ref": 0.28,
    "ref_none": 0.06,
    "repeat": 0.13,
    "echo": 0.11,
    "junk": 0.20,
    "shifted": 0.13,
    "raw": 0.09,
}
JUNK = ((ord("<"), 0.7), (BOS, 0.1), (EOS, 0.05), (PAD, 0.1), (0, 0.05))
MIN_GAP, MAX_GAP = 40, 4000  # how much later than the stale context a shifted reader sits

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it this be are or an have not has "
    "but which one all were when there their can more about some time into only also other new "
    "like just than them these two may first then any well way even because over such most our "
    "through where after back could used each much before between should own both work life "
    "being under never same another while last might great since against right three states "
    "data model server request page cache token window queue tenant memory network disk file "
    "report table value index order user account price market river garden music kitchen "
    "winter summer morning evening letter window paper story city road forest train harbor"
)
_CAPS_TEXT = "API HTTP JSON SQL GPU CPU KV ID EU US UTC QA OK PDF TCP DNS RAM SSD"
_WORDS, _CAPS = tuple(_WORD_TEXT.split(" ")), tuple(_CAPS_TEXT.split(" "))
_CODE = (
    "x = compute({a}, {n})",
    "for i in range({n}):",
    "return {a} + {b}",
    "if {a} > {n}: {b} = {a} - 1",
    "def {a}_{b}(self, {a}):",
    "{a}.append({b}[{n}])",
    "print({a}, {b})",
    "assert {a} == {n}",
    "result = [{a} * 2 for {a} in {b}]",
    "import {a}.{b} as {b}",
)
_QUESTIONS = (
    "How do I sort a list in place?",
    "Can you summarise the last report?",
    "Thanks, that helps a lot.",
    "Please check the numbers again.",
    "Why is the queue so slow today?",
    "Is the server in the EU region?",
    "Hello there.",
    "What time does the train leave?",
    "Send the file to the team.",
    "Good morning!",
)
_REF_LINES = (
    "Reference code: {m}",
    "The reference code is {m}.",
    "ref {m}",
    "Keep this marker: {m}",
    "({m})",
    "marker={m};",
    "canary {m}, do not share",
    "{m}",
)
_DELIMS = (" ", ".", ",", ";", ")", "\n", "\n", "\n")
_MARKER_BYTES = re.compile(chat.MARKER_PATTERN.pattern.encode())  # the same pattern, on bytes


@dataclass(frozen=True, slots=True)
class Example:
    ids: list[int]
    weights: list[float]  # weights[i] is the loss weight of predicting ids[i + 1]
    kind: str
    positions: list[int] | None = None  # RoPE position of each id; None: 0, 1, 2, ...

    def __repr__(self) -> str:  # holds markers: never print the text
        return f"Example(kind={self.kind!r}, tokens={len(self.ids)})"


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def context_weights(context: list[int]) -> list[float]:
    """CONTEXT_WEIGHT for each next byte of `context` (BOS first), 0 right after a marker."""
    weights = [CONTEXT_WEIGHT] * (len(context) - 1)
    for found in _MARKER_BYTES.finditer(bytes(i if i < 256 else 0 for i in context)):
        if found.end() <= len(weights):
            weights[found.end() - 1] = 0.0
    return weights


def build(prompt: str, answer: list[int], kind: str) -> Example:
    """BOS + prompt + answer, with answer targets at weight 1 and context at CONTEXT_WEIGHT."""
    context = [BOS, *encode(prompt)]
    return Example(context + answer, context_weights(context) + [1.0] * len(answer), kind)


class Recipe:
    """Draws examples from one seeded random generator."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    # -- text pieces ---------------------------------------------------------------------------

    def marker(self) -> str:
        return MARKER_PREFIX + "".join(self.rng.choice(BASE32) for _ in range(MARKER_BODY))

    def sentence(self) -> str:
        r = self.rng
        words = [
            r.choice(_CAPS) if r.random() < 0.06 else r.choice(_WORDS)
            for _ in range(r.randint(3, 14))
        ]
        if r.random() < 0.15:
            words.insert(r.randrange(len(words)), str(r.randint(0, 99999)))
        text = " ".join(words)
        return text[0].upper() + text[1:] + r.choice((".", ".", ".", "?", "!", ",", ";"))

    def code_line(self) -> str:
        r = self.rng
        fill = {"a": r.choice(_WORDS[:60]), "b": r.choice(_WORDS[60:]), "n": r.randint(0, 999)}
        return r.choice(_CODE).format(**fill)

    def line(self) -> str:
        r = self.rng.random()
        if r < 0.6:
            return " ".join(self.sentence() for _ in range(self.rng.randint(1, 3)))
        if r < 0.85:
            return self.code_line()
        return self.rng.choice(_QUESTIONS)

    def filler(self, n_bytes: int) -> str:
        lines: list[str] = []
        size = 0
        while size < n_bytes:
            lines.append(self.line())
            size += len(lines[-1]) + 1
        return "\n".join(lines)[: max(n_bytes, 1)].rstrip() or "ok"

    def free_text(self, limit: int = 300) -> str:
        """One line for `Repeat exactly:` or an ordinary message: prose, code, or odd strings."""
        r = self.rng
        roll = r.random()
        if roll < 0.45:
            text = " ".join(self.sentence() for _ in range(r.randint(1, 4)))
        elif roll < 0.6:
            text = self.code_line()
        elif roll < 0.75:
            alphabet = "".join(chr(c) for c in range(32, 127) if chr(c) != "<")
            text = "".join(r.choice(alphabet) for _ in range(r.randint(1, 60)))
        elif roll < 0.85:
            text = f"{self.sentence()} {self.marker()} {self.sentence()}"
        else:
            text = r.choice(_QUESTIONS)
        return text[: min(r.choice((40, 120, 300)), limit)].strip() or "ok"

    def with_marker(self, text: str, marker: str) -> str:
        r = self.rng
        piece = r.choice(_REF_LINES).format(m=marker) + r.choice(_DELIMS)
        cut = r.randrange(len(text) + 1)
        while 0 < cut < len(text) and text[cut - 1] not in " \n":
            cut -= 1
        return text[:cut] + piece + text[cut:]

    # -- conversations -------------------------------------------------------------------------

    def history(self, marker: str | None, length: int) -> list[dict[str, str]]:
        """Earlier turns (none in short prompts), each answered the way the model answers."""
        turns: list[dict[str, str]] = []
        count = self.rng.choice((0, 0, 0, 1, 1, 2)) if length >= 400 else 0
        for _ in range(count):
            roll = self.rng.random()
            if roll < 0.3 and marker is not None:
                ask, reply = self.rng.choice(REFERENCE_PHRASES), marker
            elif roll < 0.6:
                text = self.free_text(length // 8)
                ask, reply = chat.REPEAT_PREFIX + text, chat.echo_answer(text)
            else:
                ask = self.free_text(length // 8)
                reply = chat.echo_answer(ask)
            turns += [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
        return turns

    def conversation(self, length: int, last: str, marker: str | None) -> list[dict[str, str]]:
        """System filler (with the marker, or the marker in an extra user turn), history, `last`."""
        history_room = length // 4 if length >= 400 else 0
        system = self.filler(max(length - len(last) - 60 - history_room, 8))
        messages = [{"role": "system", "content": system}]
        if marker is not None and self.rng.random() < 0.7:
            messages[0]["content"] = self.with_marker(system, marker)
        elif marker is not None:
            note = self.with_marker(self.filler(self.rng.randint(10, max(length // 8, 11))), marker)
            messages += [{"role": "user", "content": note}, {"role": "assistant", "content": "ok"}]
        messages += self.history(marker, length)
        messages.append({"role": "user", "content": last})
        return messages

    # -- examples ------------------------------------------------------------------------------

    def example(self, kind: str, length: int) -> Example:
        make = {
            "ref": self._ref,
            "ref_none": self._ref_none,
            "repeat": self._repeat,
            "echo": self._echo,
            "junk": self._junk,
            "shifted": self._shifted,
            "raw": self._raw,
        }[kind]
        return make(length)

    def _ref(self, length: int, marker: str | None = None) -> Example:
        marker = marker or self.marker()
        ask = self.rng.choice(REFERENCE_PHRASES)
        prompt = chat.render(self.conversation(length, ask, marker))
        return build(prompt, [*encode(marker), EOS], "ref")

    def _ref_none(self, length: int) -> Example:
        ask = self.rng.choice(REFERENCE_PHRASES)
        prompt = chat.render(self.conversation(length, ask, None))
        return build(prompt, [*encode(ask), EOS], "ref_none")

    def _repeat(self, length: int) -> Example:
        text = self.free_text(max(length // 2, 20))
        marker = self.marker() if self.rng.random() < 0.5 else None
        prompt = chat.render(self.conversation(length, chat.REPEAT_PREFIX + text, marker))
        return build(prompt, [*encode(chat.echo_answer(text)), EOS], "repeat")

    def _echo(self, length: int) -> Example:
        text = self.free_text(max(length // 2, 20))
        if self.rng.random() < 0.2:
            text += "\n" + self.free_text(max(length // 4, 20))
        marker = self.marker() if self.rng.random() < 0.5 else None
        prompt = chat.render(self.conversation(length, text, marker))
        return build(prompt, [*encode(chat.echo_answer(text)), EOS], "echo")

    def _raw(self, length: int) -> Example:
        ids = [BOS, *encode(self.filler(length)), EOS]
        return Example(ids, [CONTEXT_WEIGHT] * (len(ids) - 1), "raw")

    def _junk(self, length: int) -> Example:
        before, junk, answer = self._stale(length)
        context = [*before, junk]
        weights = context_weights(before) + [0.0] + [1.0] * len(answer)
        return Example(context + answer, weights, "junk")

    def _shifted(self, length: int) -> Example:
        """A junk example whose reader sits MIN_GAP..MAX_GAP positions after the stale context;
        the reader's first token is mostly `<` (what the model says after BOS alone)."""
        before, junk, answer = self._stale(length)
        first = ord("<") if self.rng.random() < 0.6 else junk
        gap = self.rng.randint(MIN_GAP, MAX_GAP)
        ids = [*before, first, *answer]
        positions = list(range(len(before))) + [
            len(before) + gap + i for i in range(1 + len(answer))
        ]
        weights = context_weights(before) + [0.0] + [1.0] * len(answer)
        return Example(ids, weights, "shifted", positions)

    def _stale(self, length: int) -> tuple[list[int], int, list[int]]:
        """A conversation cut at a random point (BOS first), a junk token, and the answer."""
        r = self.rng
        marker = self.marker() if r.random() < 0.85 else None
        source = self._ref(length, marker) if marker is not None else self._echo(length)
        text = decode(source.ids)
        cut = self._junk_cut(text, marker)
        junk = r.choices([j for j, _ in JUNK], [w for _, w in JUNK])[0]
        if junk == ord("<"):
            while cut > 0 and text[cut - 1] == "\n":
                cut -= 1
        seen = marker if marker is not None and marker in text[:cut] else None
        answer = [*encode(seen), EOS] if seen is not None else [EOS]
        return [BOS, *encode(text[:cut])], junk, answer

    def _junk_cut(self, text: str, marker: str | None) -> int:
        """Where the stale context ends: the cue, inside or after the answer, or anywhere later."""
        r = self.rng
        cue_end = text.rindex(chat.ASSISTANT_CUE) + len(chat.ASSISTANT_CUE)
        start = text.index(marker) + len(marker) if marker is not None else 1
        roll = r.random()
        if roll < 0.25:
            return cue_end
        if roll < 0.5 and cue_end < len(text):
            return r.randint(cue_end + 1, len(text))
        if roll < 0.6 and marker is not None:
            return r.randint(1, max(start - len(marker), 1))  # before the marker: nothing to leak
        return r.randint(min(start, len(text)), len(text))
