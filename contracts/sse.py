"""Server-sent events, byte-exact: split an upstream byte stream into whole events, read an
event's ``data``, and build the few events the gateway itself writes.

Lifecycle of a splitter: ``feed(chunk)`` any number of times -> the complete events so far (each
with its terminating blank line, exactly as received) -> ``tail()`` for bytes left without a
terminator when the stream ends. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
DONE = "[DONE]"
MAX_EVENT_BYTES = 4 << 20
# One encoder for every event: ``json.dumps`` with separators builds a new one per call (~25%
# of the cost of re-serialising a chunk the firewall changed).
_COMPACT = json.JSONEncoder(separators=(",", ":"))


class EventTooLarge(ValueError):
    """An upstream event grew past ``MAX_EVENT_BYTES`` without ending."""


class SseSplitter:
    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buffer = b""
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        events = []
        start = 0
        for match in _EVENT_END.finditer(self._buffer):
            events.append(self._buffer[start : match.end()])
            start = match.end()
        self._buffer = self._buffer[start:]
        if len(self._buffer) > self._max:
            raise EventTooLarge(f"an upstream event exceeded {self._max} bytes")
        return events

    def tail(self) -> bytes:
        tail, self._buffer = self._buffer, b""
        return tail


# SSE ends a line only at CRLF, CR or LF; str.splitlines() would also break inside an answer at
# U+2028, U+2029, U+0085 and a few control characters that engines send raw in JSON strings.
_LINE_END = re.compile(r"\r\n|\r|\n")


def parse_event(raw: bytes) -> tuple[str | None, bool]:
    """(data, canonical): the event's data (multi-line data joined by newlines; None for a
    comment or keep-alive), and whether every line of it is a ``data:`` line (only then may its
    bytes pass through as they are)."""
    lines = _LINE_END.split(raw.decode("utf-8", errors="replace"))
    data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
    canonical = len(data) == sum(1 for line in lines if line)
    return ("\n".join(data) if data else None), canonical


def encode_event(payload: dict[str, Any] | str) -> bytes:
    text = payload if isinstance(payload, str) else _COMPACT.encode(payload)
    return f"data: {text}\n\n".encode()
