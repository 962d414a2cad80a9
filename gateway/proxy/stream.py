"""The streamed data plane: upstream bytes -> ``StreamPump`` -> an event relay -> the client.

A pump is pushed each upstream read (``data``; ``end`` or ``lost`` when the engine's stream
stops), cuts it into SSE events, hands each to the relay of the stream's event format
(``EventRelay``: the chat/completions ``StreamRelay``, or the Responses API's
``gateway.proxy.responses.ResponsesRelay``; the relay owns every check), and
writes what the relay gave for the read to the client in one write (the bytes of one read are all
there at once: joining them delays none). It knows no event format, no HTTP framing and no
server: a ``ClientSink`` writes, and the pump is fed either straight from the engine connection's
reads (``PushSource``: no task wakes up per read) or by a loop over ``UpstreamStream.chunks``.

Per event it keeps no object of its own: the relay appends to one reused list, and the latency of
the stream's text events is kept as a few numbers (``TokenClock``: first and last text, the gaps
counted into the inter-token histogram's buckets), recorded once, at the request's exit.
When the relay says the stream ended (``[DONE]``, a cut, an error, the engine gone), ``done``
resolves; nothing more is read or written.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Protocol

from contracts.engine import HandoffProof
from contracts.plugins import Cut
from contracts.sse import MAX_EVENT_BYTES, SseSplitter
from gateway.lifecycle import Phase


class EventRelay(Protocol):
    """An event format's relay (``gateway.proxy.relay.StreamRelay`` for chat and completions)."""

    end: Phase | None
    text_events: int

    def relay_event(self, raw: bytes, out: list[bytes]) -> bool:
        """Append what the client gets for one event to ``out``; True when the stream ends."""
        ...

    def relay_end(self, out: list[bytes]) -> None:
        """The engine's stream stopped without the format's own end: append the last words."""
        ...

    def invalid(self, out: list[bytes]) -> bool:
        """The engine sent bytes that are no event (one grew past ``MAX_EVENT_BYTES``)."""
        ...


class RelayedStream(EventRelay, Protocol):
    """A relay as the request path reads it once the stream ended (``gateway.proxy.service``):
    the engine's counts, the handoff proof, and how the stream ended."""

    end_code: str | None
    cut: Cut | None
    handoff: HandoffProof | None
    finish_reasons: list[str]

    @property
    def completion_tokens(self) -> int | None: ...

    @property
    def prompt_tokens(self) -> int | None: ...


class ClientSink(Protocol):
    def write(self, data: bytes) -> None:
        """Send ``data`` now, or buffer it for the next drain; never blocks."""
        ...


class TokenClock:
    """The arrival times of a stream's text events, as a few numbers kept on the request: the
    first and the last, and the gaps between them counted into ``bounds`` (the inter-token
    histogram's buckets, ``gateway.metrics``) with their sum."""

    __slots__ = ("bounds", "counts", "first_s", "gap_sum", "last_s")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.gap_sum = 0.0
        self.first_s: float | None = None
        self.last_s = 0.0

    @property
    def gaps(self) -> int:
        return sum(self.counts)


class StreamPump:
    """One stream's pump; a ``BodySink`` for a ``PushSource``."""

    __slots__ = (
        "_buffer",
        "_out",
        "_relay",
        "_sink",
        "_splitter",
        "_ticks",
        "clock",
        "done",
        "first_write_s",
        "last",
    )

    def __init__(self, relay: EventRelay, sink: ClientSink, clock: TokenClock) -> None:
        self._relay = relay
        self._sink = sink
        self._buffer = b""
        self._out: list[bytes] = []
        self._splitter: SseSplitter | None = None  # once a CR shows up: every SSE line end
        self._ticks = 0
        self.clock = clock
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.first_write_s: float | None = None
        self.last = b""  # what the relay gave for the event that ended the stream: sent last

    def data(self, chunk: bytes) -> None:
        if self.done.done():
            return
        relay, out = self._relay, self._out
        if self._splitter is not None or b"\r" in chunk:
            self._split(chunk)
            return
        buffer = self._buffer + chunk if self._buffer else chunk
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            end += 2
            ended = relay.relay_event(buffer[start:end], out)
            if relay.text_events != self._ticks:
                self._tick()
            if ended:
                self._close()
                return
            start = end
        self._buffer = buffer[start:] if start else buffer
        if len(self._buffer) > MAX_EVENT_BYTES:
            relay.invalid(out)
            self._buffer = b""
            self._close()
            return
        if out:  # the usual read: one write (``_flush`` inlined)
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if self.first_write_s is None:
                self.first_write_s = time.perf_counter()
            self._sink.write(data)

    def _split(self, chunk: bytes) -> None:
        """The general splitter (CRLF and CR line ends too), for the rest of the stream."""
        if self._splitter is None:
            self._splitter = SseSplitter()
            chunk, self._buffer = self._buffer + chunk, b""
        relay, out = self._relay, self._out
        try:
            events = self._splitter.feed(chunk)
        except ValueError:  # an event past MAX_EVENT_BYTES
            relay.invalid(out)
            events = []
        for raw in events:
            ended = relay.relay_event(raw, out)
            if relay.text_events != self._ticks:
                self._tick()
            if ended:
                break
        if relay.end is not None:
            self._close()
        else:
            self._flush()

    def _tick(self) -> None:
        """Text events arrived: time them (several in one read are one gap apart of ~0)."""
        clock, now = self.clock, time.perf_counter()
        for _ in range(self._relay.text_events - self._ticks):
            if clock.first_s is None:
                clock.first_s = now
            else:
                gap = now - clock.last_s
                clock.counts[bisect_left(clock.bounds, gap)] += 1
                clock.gap_sum += gap
            clock.last_s = now
        self._ticks = self._relay.text_events

    def _flush(self) -> None:
        out = self._out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if self.first_write_s is None:
                self.first_write_s = time.perf_counter()
            self._sink.write(data)

    def _close(self) -> None:
        """The stream ended: the read's last bytes wait for the request's exit (a client that has
        read its whole answer finds it audited), nothing more is read."""
        self.last = b"".join(self._out)
        self._out.clear()
        self.done.set_result(None)

    def end(self) -> None:
        if self.done.done():
            return
        self._relay.relay_end(self._out)
        self._close()

    def lost(self, error: Exception) -> None:
        self.end()  # the engine dropped: the relay ends the stream as an upstream error
