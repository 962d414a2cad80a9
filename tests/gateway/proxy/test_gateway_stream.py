"""The streamed data plane's pump (``gateway.proxy.stream``): upstream reads cut into SSE events
for the relay, one client write per read, the last bytes kept for the request's exit, the text
events' times kept as bucket counts, and nothing read or written once the stream ended."""

from __future__ import annotations

import json

import pytest

from contracts.plugins import PassThroughGuard
from contracts.sse import MAX_EVENT_BYTES
from gateway.lifecycle import Phase
from gateway.proxy.relay import StreamRelay
from gateway.proxy.stream import StreamPump, TokenClock
from gateway.upstream.base import Endpoint

BOUNDS = (0.001, 0.01, 0.1)


def _event(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    chunk = {"id": "c", "choices": [choice]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"  # compact


class _Sink:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


def _pump() -> tuple[StreamPump, StreamRelay, _Sink]:
    relay = StreamRelay(endpoint=Endpoint.CHAT, open_guard=PassThroughGuard, wants_usage=False)
    sink = _Sink()
    return StreamPump(relay, sink, TokenClock(BOUNDS)), relay, sink


async def test_one_write_per_read_events_split_anywhere_and_the_end_kept_for_the_exit() -> None:
    pump, relay, sink = _pump()
    first, second, third = _event("alpha"), _event(" beta"), _event(" gamma", "stop")
    pump.data(first + second[:7])  # a read ending inside an event
    pump.data(second[7:] + third)
    assert sink.writes == [first, second + third]  # the events of one read in one write
    assert relay.text_events == 3 and not pump.done.done()
    pump.data(b"data: [DONE]\n\n")
    assert pump.done.done() and relay.end is Phase.COMPLETED
    assert pump.last == b"data: [DONE]\n\n" and len(sink.writes) == 2  # [DONE] waits for the exit
    pump.data(_event("late"))  # nothing after the end
    assert len(sink.writes) == 2 and pump.last == b"data: [DONE]\n\n"


async def test_crlf_events_take_the_general_splitter_for_the_rest_of_the_stream() -> None:
    pump, relay, sink = _pump()
    crlf = _event("alpha").replace(b"\n\n", b"\r\n\r\n")
    pump.data(_event("a")[:10])
    pump.data(_event("a")[10:] + crlf)
    pump.data(_event(" b"))
    assert relay.text_events == 3
    # the CRLF event is written anew (LF, the same JSON); the others pass byte for byte
    assert b"".join(sink.writes) == _event("a") + _event("alpha") + _event(" b")


async def test_an_engine_that_stops_early_ends_the_stream_as_an_upstream_error() -> None:
    pump, relay, sink = _pump()
    pump.data(_event("alpha"))
    pump.lost(ConnectionError("reset"))
    assert pump.done.done() and relay.end is Phase.FAILED
    assert b'"code":"upstream_error"' in pump.last and sink.writes == [_event("alpha")]


async def test_an_event_that_never_ends_is_refused_at_the_bound() -> None:
    pump, relay, _ = _pump()
    pump.data(b"data: " + b"x" * (MAX_EVENT_BYTES + 1))
    assert pump.done.done() and relay.end is Phase.FAILED
    assert b"invalid event" in pump.last


async def test_text_event_times_are_bucket_counts_one_ttft_and_n_minus_one_gaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the first text event, the first write's time, then the three later text events
    now = iter([10.0, 10.0001, 10.0005, 10.0055, 10.0555])
    monkeypatch.setattr("gateway.proxy.stream.time.perf_counter", lambda: next(now))
    pump, _, _ = _pump()
    for text in ("a", "b", "c", "d"):
        pump.data(_event(text))
    clock = pump.clock
    assert clock.first_s == 10.0 and clock.last_s == 10.0555 and pump.first_write_s == 10.0001
    # gaps 0.5 ms, 5 ms, 50 ms: one in each bucket up to 0.1 s, none above
    assert clock.counts == [1, 1, 1, 0] and clock.gaps == 3
    assert clock.gap_sum == pytest.approx(0.0555)
