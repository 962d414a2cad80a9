"""A stream's events leave the gateway in one write per upstream read: the bytes one read brings
are all there at once, so joining them delays none of them, and a busy gateway (whose reads carry
several events) writes less often. Every byte is still relayed as the engine sent it. Served over
real HTTP by the gateway's own protocol, so the writes are the socket writes below ASGI
(``DirectReply.write``); the end of the stream leaves after the request's exit. A whole answer
(or a refusal) leaves in one write, its head and body together."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from gateway_harness import bearer, running_gateway
from gateway_standin import StandInEngine

from gateway.config import GatewaySettings
from gateway.proxy.reply import DirectReply
from gateway.proxy.server import DataPlaneProtocol
from gateway.upstream.base import Upstream, UpstreamCall, UpstreamReply, UpstreamStream


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})


FIRST_READ = _chunk("alpha") + _chunk(" beta") + _chunk(" gamma", "length")
USAGE = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
SECOND_READ = _event({"id": "cmpl-1", "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"


class _TwoReads(UpstreamStream):
    async def chunks(self) -> AsyncIterator[bytes]:
        yield FIRST_READ
        yield SECOND_READ

    async def aclose(self) -> None:
        return None


class _Engine(Upstream):
    async def complete(self, call: UpstreamCall) -> UpstreamReply:
        raise AssertionError("only streams here")

    async def stream(self, call: UpstreamCall) -> UpstreamStream | UpstreamReply:
        return _TwoReads()

    async def close(self) -> None:
        return None


async def test_events_of_one_upstream_read_leave_in_one_write_byte_for_byte(
    make_settings: Callable[..., GatewaySettings],
    standin: StandInEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(
        engines=[{"name": "standin", "kind": "bundled", "base_url": standin.url}]
    )
    writes: list[bytes] = []
    direct_write = DirectReply.write

    def recording(reply: DirectReply, data: bytes) -> None:
        writes.append(data)
        direct_write(reply, data)

    monkeypatch.setattr(DirectReply, "write", recording)
    async with running_gateway(settings) as gw:
        gw.state.direct = _Engine()
        _, key = await gw.create_tenant("acme")
        r = await gw.client.post(
            "/v1/completions",
            json={"model": "standin-model", "prompt": "alpha", "max_tokens": 3, "stream": True},
            headers=bearer(key),
        )
    assert r.status_code == 200, r.text
    # the three events of the first read in one socket write, as the engine sent them; the
    # usage chunk (the client did not ask for it) is dropped; the final chunk (the gateway's
    # kvguard object) and [DONE] leave after the exit
    assert writes == [FIRST_READ]
    done = b"data: [DONE]\n\n"
    assert r.content.startswith(FIRST_READ) and r.content.endswith(done)
    final = json.loads(r.content[len(FIRST_READ) : -len(done)].removeprefix(b"data: "))
    assert final["choices"] == [] and "usage" not in final
    assert final["kvguard"] == {
        "request_id": r.headers["x-kvguard-request-id"],
        "isolation": "no_handoff",
        "redactions": 0,
    }


class _CountedSocket:
    """The connection's transport, its writes counted (everything else is the transport's)."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def test_a_whole_answer_and_a_refusal_leave_in_one_write(
    make_settings: Callable[..., GatewaySettings],
    standin: StandInEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Head and body of a whole answer in one socket write (two writes were two system calls and
    two wake-ups of the client), the same bytes the client reads; a refusal (401) likewise."""
    settings = make_settings(
        engines=[{"name": "standin", "kind": "bundled", "base_url": standin.url}]
    )
    writes: list[bytes] = []
    made = DataPlaneProtocol.connection_made

    def counted(protocol: DataPlaneProtocol, transport: Any) -> None:
        made(protocol, _CountedSocket(transport, writes))

    monkeypatch.setattr(DataPlaneProtocol, "connection_made", counted)
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        body = {"model": "standin-model", "prompt": "alpha beta", "max_tokens": 2}
        writes.clear()
        answer = await gw.client.post("/v1/completions", json=body, headers=bearer(key))
        assert answer.status_code == 200, answer.text
        assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert writes[0].endswith(answer.content)
        writes.clear()
        refused = await gw.client.post("/v1/completions", json=body, headers=bearer("sk-wrong"))
        assert refused.status_code == 401
        assert len(writes) == 1 and writes[0].endswith(refused.content)
        writes.clear()  # a client that closes: the one write, then the close
        headers = {**bearer(key), "connection": "close"}
        last = await gw.client.post("/v1/completions", json=body, headers=headers)
        assert last.status_code == 200 and last.headers["connection"] == "close"
        assert len(writes) == 1 and writes[0].endswith(last.content)
