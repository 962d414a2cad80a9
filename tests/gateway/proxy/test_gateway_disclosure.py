"""What the relay tells a tenant about its answer's path (``gateway.proxy.disclosure``), as pure
pieces: the address scrub on messages an engine writes, the isolation verdict, and the stream's
final chunk. End to end (the real engine, every error path):
``tests/hostile/test_hostile_disclosure.py``.
"""

from __future__ import annotations

import json

import pytest

from contracts.engine import HandoffProof
from contracts.plugins import PassThroughGuard
from gateway.proxy.disclosure import INTERNAL, Disclosure, isolation, without_addresses
from gateway.proxy.relay import StreamRelay
from gateway.upstream.base import Endpoint


@pytest.mark.parametrize(
    "address",
    [
        "http://10.0.0.7:8000/v1",
        "https://prefill.internal/engine/capacity",
        "10.0.0.7",
        "10.0.0.7:8000",
        "decode-0.engines.svc.cluster.local:8100",
        "localhost:8100",
        "[fd00::7]:8000",
    ],
)
def test_every_address_form_is_taken_out_of_an_engine_message(address: str) -> None:
    message = f"the prefill role is unavailable: {address} answered HTTP 503"
    assert without_addresses(message) == (
        f"the prefill role is unavailable: {INTERNAL} answered HTTP 503"
    )


def test_a_message_without_an_address_is_left_as_it_is() -> None:
    message = "This model's maximum context length is 2048 tokens (you asked for 4096)."
    assert without_addresses(message) == message


def _proof(transferred: int) -> HandoffProof:
    return HandoffProof(3, "ok", 8, transferred, skipped_checks=("checksum",))


def test_the_isolation_verdict() -> None:
    assert isolation(None) == "no_handoff"
    assert isolation(_proof(8)) == "handoff_verified"
    assert isolation(_proof(1)) == "handoff_mismatch"


def _relay(wants_usage: bool) -> StreamRelay:
    return StreamRelay(
        endpoint=Endpoint.CHAT,
        open_guard=PassThroughGuard,
        wants_usage=wants_usage,
        disclosure=Disclosure("req-1", PassThroughGuard),
    )


def _run(relay: StreamRelay, objs: list[object]) -> list[object]:
    out: list[bytes] = []
    for obj in objs:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        relay.relay_event(f"data: {data}\n\n".encode(), out)
    blocks = [b[6:] for b in b"".join(out).decode().split("\n\n") if b.startswith("data: ")]
    return [b if b == "[DONE]" else json.loads(b) for b in blocks]


ENGINE_OBJECT = {"kvguard": {"role": "decode", "handoff": _proof(8).as_dict()}}
CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
USAGE = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}


@pytest.mark.parametrize("wants_usage", [False, True])
def test_the_final_chunk_carries_the_gateways_object_not_the_engines(wants_usage: bool) -> None:
    finish = {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    events = _run(
        _relay(wants_usage),
        [
            {**CHUNK, "choices": [{"index": 0, "delta": {"content": "hi"}}]},
            {**finish, **ENGINE_OBJECT},
            {**CHUNK, "choices": [], "usage": USAGE, **ENGINE_OBJECT},
            "[DONE]",
        ],
    )
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert isinstance(final, dict)
    expected = {"request_id": "req-1", "isolation": "handoff_verified", "redactions": 0}
    assert final["kvguard"] == expected and final["choices"] == []
    assert ("usage" in final) is wants_usage
    assert events[1] == finish  # the engine's object left the finish chunk
    assert sum("kvguard" in json.dumps(e) for e in events) == 1


def test_an_engines_error_event_goes_out_alone_and_without_addresses() -> None:
    error = {"message": "lost 10.0.0.7:8000", "type": "server_error", "code": "gone"}
    events = _run(_relay(False), [{"error": error, **ENGINE_OBJECT}])
    assert events == [{"error": {**error, "message": f"lost {INTERNAL}"}}]
