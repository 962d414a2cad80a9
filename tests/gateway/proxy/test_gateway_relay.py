"""Pure pieces of the response path: SSE framing, the stream relay, the request lifecycle."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.plugins import Cut, Emit, PassThroughGuard, StreamGuard
from contracts.sse import EventTooLarge, SseSplitter, encode_event, parse_event
from gateway.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    InvalidTransition,
    Phase,
    TenantStatus,
    check_tenant_transition,
    check_transition,
)
from gateway.proxy.body import relay_body
from gateway.proxy.relay import StreamRelay
from gateway.upstream.base import Endpoint

STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"content":"he"},"finish_reason":null}]}\n\n'
    b": keep-alive\n\n"
    b'data: {"choices":[{"index":0,"delta":{"content":"llo"},"finish_reason":"stop"}]}\r\n\r\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
    b"data: [DONE]\n\n"
)


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_splitter_is_exact_at_any_chunking(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    splitter = SseSplitter()
    events = [event for piece in pieces for event in splitter.feed(piece)]
    assert b"".join(events) == STREAM and splitter.tail() == b""
    assert len(events) == 5


def test_event_data_and_limits() -> None:
    assert parse_event(b"data: [DONE]\n\n") == ("[DONE]", True)
    assert parse_event(b": comment\n\n") == (None, False)
    assert parse_event(b"data: a\ndata: b\n\n") == ("a\nb", True)
    assert parse_event(b"data: a\r\ndata: b\rdata: c\n\n") == ("a\nb\nc", True)
    assert encode_event({"a": 1}) == b'data: {"a":1}\n\n'
    with pytest.raises(EventTooLarge):
        SseSplitter(max_event_bytes=10).feed(b"data: " + b"x" * 20)


# Characters str.splitlines() breaks at but SSE does not: SSE ends a line only at CR, LF or CRLF.
NOT_SSE_LINE_BREAKS = "\u2028\u2029\u0085\x0b\x0c\x1c\x1d\x1e"


def test_only_cr_and_lf_end_an_sse_line() -> None:
    payload = json.dumps({"text": NOT_SSE_LINE_BREAKS}, ensure_ascii=False)
    assert parse_event(f"data: {payload}\n\n".encode()) == (payload, True)


def test_an_answer_holding_unicode_line_separators_streams_through() -> None:
    """Engines that serialise with raw UTF-8 (pydantic's model_dump_json) send U+2028 as is."""
    chunk = {"choices": [{"index": 0, "delta": {"content": NOT_SSE_LINE_BREAKS}}]}
    raw = f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
    relay = StreamRelay(endpoint=Endpoint.CHAT, open_guard=PassThroughGuard, wants_usage=False)
    step = relay.on_event(raw)
    assert (step.out, step.end) == ([raw], None)


def _run(relay: StreamRelay) -> tuple[bytes, Phase | None]:
    out, end = b"", None
    for event in SseSplitter().feed(STREAM):
        step = relay.on_event(event)
        out += b"".join(step.out)
        end = step.end or end
        if step.end:
            break
    return out, end


def test_relay_passes_bytes_and_drops_unrequested_usage() -> None:
    """Events of one ``data:`` line of compact JSON pass byte for byte; the one whose lines end
    in CRLF is written anew with LF (the same JSON), the comment becomes the keep-alive."""
    relayed = STREAM.replace(b"\r\n\r\n", b"\n\n")
    relay = StreamRelay(endpoint=Endpoint.CHAT, open_guard=PassThroughGuard, wants_usage=False)
    out, end = _run(relay)
    assert out == relayed.replace(
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,'
        b'"total_tokens":5}}\n\n',
        b"",
    )
    assert (end, relay.completion_tokens, relay.prompt_tokens) == (Phase.COMPLETED, 2, 3)
    relay = StreamRelay(endpoint=Endpoint.CHAT, open_guard=PassThroughGuard, wants_usage=True)
    assert _run(relay)[0] == relayed


class HoldAll(StreamGuard):
    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> Emit | Cut:
        self.held += text
        return Emit("")

    def finish(self) -> Emit | Cut:
        out, self.held = self.held.upper(), ""
        return Emit(out)


def test_relay_rewrites_only_changed_text_and_flushes_on_finish() -> None:
    relay = StreamRelay(endpoint=Endpoint.CHAT, open_guard=HoldAll, wants_usage=False)
    out, end = _run(relay)
    events = [e for e in out.decode().split("\n\n") if e]
    assert events[0] == ": keep-alive"  # "he" held back: nothing sent for that chunk
    final = json.loads(events[1].removeprefix("data: "))
    assert final["choices"][0] == {
        "index": 0,
        "delta": {"content": "HELLO"},
        "finish_reason": "stop",
    }
    assert events[2] == "data: [DONE]" and end is Phase.COMPLETED


def test_relay_errors_and_early_end() -> None:
    relay = StreamRelay(
        endpoint=Endpoint.COMPLETIONS, open_guard=PassThroughGuard, wants_usage=False
    )
    step = relay.on_event(b'data: {"error": {"code": "engine_fault", "message": "x"}}\n\n')
    assert (step.end, step.code) == (Phase.FAILED, "engine_fault")
    step = relay.on_event(b"data: {nope\n\n")
    assert (step.end, step.code) == (Phase.FAILED, "upstream_error")
    step = relay.on_upstream_end()
    assert step.end is Phase.FAILED and b'"code":"upstream_error"' in step.out[0]


def test_relay_body_guard() -> None:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}
    assert relay_body(Endpoint.CHAT, body, PassThroughGuard) is body
    changed = relay_body(Endpoint.CHAT, body, HoldAll)
    assert isinstance(changed, dict) and changed["choices"][0]["message"]["content"] == "HI"
    assert body["choices"][0]["message"]["content"] == "hi"  # the original is not mutated


def test_request_lifecycle_table() -> None:
    assert all(TRANSITIONS[phase] == frozenset() for phase in TERMINAL)
    path = [Phase.ROUTED, Phase.ADMITTED, Phase.FORWARDED, Phase.STREAMING, Phase.COMPLETED]
    phase = Phase.RECEIVED
    for target in path:
        phase = check_transition(phase, target)
    with pytest.raises(InvalidTransition):
        check_transition(Phase.COMPLETED, Phase.FAILED)
    with pytest.raises(InvalidTransition):
        check_transition(Phase.RECEIVED, Phase.STREAMING)
    with pytest.raises(InvalidTransition):
        check_transition(Phase.ADMITTED, Phase.CUT)  # nothing to cut before the engine answers
    assert check_tenant_transition(TenantStatus.ACTIVE, TenantStatus.DISABLED) is (
        TenantStatus.DISABLED
    )
    assert check_tenant_transition(TenantStatus.DISABLED, TenantStatus.DISABLED) is (
        TenantStatus.DISABLED
    )
