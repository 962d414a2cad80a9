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


def event_data(raw: bytes) -> str | None:
    """The event's data (multi-line data joined by newlines), or None for comments/keep-alives."""
    lines = raw.decode("utf-8", errors="replace").splitlines()
    data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
    return "\n".join(data) if data else None


def encode_event(payload: dict[str, Any] | str) -> bytes:
    text = payload if isinstance(payload, str) else _COMPACT.encode(payload)
    return f"data: {text}\n\n".encode()
