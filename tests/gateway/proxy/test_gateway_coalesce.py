"""A stream's events leave the gateway in one write per upstream read: the bytes one read brings
are all there at once, so joining them delays none of them, and a busy gateway (whose reads carry
several events) writes less often. Every byte is still relayed as the engine sent it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
from gateway_harness import bearer
from gateway_standin import StandInEngine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.app import create_app
from gateway.config import GatewaySettings
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


def _recording(app: ASGIApp, writes: list[bytes]) -> ASGIApp:
    async def recorder(scope: Scope, receive: Receive, send: Send) -> None:
        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                writes.append(message["body"])
            await send(message)

        await app(scope, receive, recording_send)

    return recorder


async def test_events_of_one_upstream_read_leave_in_one_write_byte_for_byte(
    make_settings: Callable[..., GatewaySettings], standin: StandInEngine
) -> None:
    settings = make_settings(
        engines=[{"name": "standin", "kind": "bundled", "base_url": standin.url}]
    )
    app = create_app(settings)
    writes: list[bytes] = []
    async with app.router.lifespan_context(app):
        app.state.gateway.direct = _Engine()
        transport = httpx.ASGITransport(app=_recording(app, writes))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            created = await client.post(
                "/admin/tenants", json={"name": "acme"}, headers=bearer(settings.admin_secret())
            )
            key = created.json()["key"]["key"]
            writes.clear()
            r = await client.post(
                "/v1/completions",
                json={"model": "standin-model", "prompt": "alpha", "max_tokens": 3, "stream": True},
                headers=bearer(key),
            )
    assert r.status_code == 200, r.text
    # the three events of the first read in one write, as the engine sent them; the usage chunk
    # (the client did not ask for it) is dropped and [DONE] follows in the second read's write
    assert writes == [FIRST_READ, b"data: [DONE]\n\n"]
    assert r.content == FIRST_READ + b"data: [DONE]\n\n"
