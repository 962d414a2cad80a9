"""A stream's usual token, relayed without reading the event it came in (``Frame``).

The relay (``gateway.proxy.relay.StreamRelay``) makes a frame from a common chunk it read in
full and delivered byte for byte, and asks it about each later event first: ``text_of`` gives
the event's text when the event is that chunk with another plain text, else None (the event is
then read in full, and the frame dropped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

from contracts.plugins import StreamGuard

# what a JSON string literal holds only escaped: its own quote, a backslash, a control character
_ESCAPED = re.compile(rb'["\\\x00-\x1f]')


@dataclass(frozen=True, slots=True)
class Frame:
    """The bytes of a stream's last common chunk around its text: a later event made of the same
    bytes around another plain text is that chunk with the text changed, and goes out as it came
    once its guard passes the text -- without parsing it, serialising it twice or walking it.

    Sound because the chunk it was cut from went through every check (``relay_event``'s common
    chunk: one choice, not finished, no logprobs, usage, error, handoff or extension, delivered
    byte for byte as its canonical JSON, its side fields screened and quiet), and the bytes around
    the text are all those checks read: the new text is one JSON string literal that needs no
    escape (no quote, backslash or control character), so the event parses to the same object
    with that text, its canonical JSON is its bytes, and its side fields and skeleton are the
    chunk's. What those checks also read from the stream's state (a finished choice, the handoff
    proof, a held side field) changes only on events that take the other paths, and every such
    event drops the frame."""

    head: bytes  # ``data: `` and the JSON up to the text's key and colon
    tail: bytes  # the JSON after the text's literal, and the blank line
    guard: StreamGuard  # the choice's guard

    @classmethod
    def of(cls, raw: bytes, text: str, *, chat: bool, guard: StreamGuard) -> Frame | None:
        """The frame of a canonical common chunk ``raw`` whose text is ``text``; None when the
        text's key and literal appear in it more than once (then nothing says which is the
        choice's)."""
        needle = (b'"content":' if chat else b'"text":') + orjson.dumps(text)
        at = raw.find(needle)
        if at == -1 or raw.find(needle, at + 1) != -1:
            return None
        key_end = raw.index(b":", at) + 1
        return cls(raw[:key_end], raw[at + len(needle) :], guard)

    def text_of(self, raw: bytes) -> str | None:
        """The text of ``raw`` when it is this frame around a plain JSON string literal."""
        head, tail = self.head, self.tail
        if not (raw.startswith(head) and raw.endswith(tail)):
            return None
        literal = raw[len(head) : len(raw) - len(tail)]
        if len(literal) < 3 or literal[0] != 0x22 or literal[-1] != 0x22:
            return None
        inner = literal[1:-1]
        if _ESCAPED.search(inner) is not None:
            return None
        try:
            return inner.decode("utf-8")
        except UnicodeDecodeError:
            return None
