"""The request path's single exit, against the real gateway served over real HTTP (uvicorn on
127.0.0.1; upstream: the stand-in engine).

However a request ends after admission -- the client goes away while the engine is still working
on a non-streaming answer, or something unexpected is raised (a response guard plug-in with a bug,
an upstream that raises what it should not) -- the tenant's concurrency lease is released, the
engine's in-flight slot is freed, and exactly one audit row says how it ended.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from gateway_harness import bearer, until
from gateway_standin import StandInEngine
from sqlalchemy import select

from contracts.plugins import GatewayHooks, GuardCapabilities
from contracts.sql import session_scope
from gateway.app import create_app
from gateway.config import GatewaySettings
from gateway.db.models import RequestAudit
from gateway.state import GatewayState
from gateway.upstream.base import Upstream, UpstreamCall, UpstreamReply, UpstreamStream
from kvguard.testing import serve

MODEL = "standin-model"
DEADLINE_S = 10.0


@dataclass
class Served:
    url: str
    state: GatewayState
    client: httpx.AsyncClient
    key: str
    tenant_id: str


@asynccontextmanager
async def served_gateway(
    settings: GatewaySettings, standin: StandInEngine, hooks: GatewayHooks | None = None
) -> AsyncIterator[Served]:
    """The gateway app under uvicorn, with one tenant allowed one request at a time."""
    app = create_app(settings, hooks=hooks)
    server = await serve(app, lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
            created = await client.post(
                "/admin/tenants",
                json={"name": "acme", "max_concurrency": 1},
                headers=bearer(settings.admin_secret()),
            )
            assert created.status_code == 201, created.text
            body = created.json()
            yield Served(
                url=server.url,
                state=app.state.gateway,
                client=client,
                key=body["key"]["key"],
                tenant_id=body["tenant"]["id"],
            )
    finally:
        if standin.controls.gate is not None:
            standin.controls.gate.set()  # a request still waiting on the engine may end now
        await server.stop()


async def audit_rows(state: GatewayState) -> list[RequestAudit]:
    await state.audit.flush()
    with session_scope(state.sessions) as session:
        return list(session.scalars(select(RequestAudit).order_by(RequestAudit.id)))


def in_flight(served: Served) -> tuple[int, int, float]:
    """(tenant leases held, the engine's in-flight count, the in-flight gauge)."""
    state = served.state
    leases = state.limiter.in_flight(served.tenant_id)  # type: ignore[attr-defined]
    engine = state.registry.get("standin")
    assert engine is not None
    gauge = state.metrics.registry.get_sample_value(
        "kvguard_gateway_in_flight_requests", {"tenant": served.tenant_id}
    )
    return leases, engine.in_flight, gauge or 0.0


async def assert_everything_released(served: Served) -> None:
    """Nothing is held, and the tenant's one concurrency slot admits the next request."""
    assert in_flight(served) == (0, 0, 0.0)
    r = await served.client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "alpha beta", "max_tokens": 2},
        headers=bearer(served.key),
    )
    assert r.status_code == 200, r.text


def _settings(make_settings: Callable[..., GatewaySettings], standin: StandInEngine) -> Any:
    return make_settings(engines=[{"name": "standin", "kind": "bundled", "base_url": standin.url}])


async def test_client_gone_during_a_non_streaming_request_releases_everything(
    make_settings, standin
) -> None:
    standin.controls.gate = asyncio.Event()  # the engine works on the answer until released
    async with served_gateway(_settings(make_settings, standin), standin) as served:
        host, port = served.url.removeprefix("http://").split(":")
        body = json.dumps({"model": MODEL, "prompt": "alpha beta gamma", "max_tokens": 3})
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {served.key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        await writer.drain()
        await until(lambda: len(standin.controls.seen_bodies) == 1, "the engine has the request")
        assert in_flight(served) == (1, 1, 1.0)

        writer.close()  # the client goes away; the engine is still working on the answer
        await writer.wait_closed()

        await until(lambda: in_flight(served) == (0, 0, 0.0), "lease and in-flight released")
        rows = await audit_rows(served.state)
        assert [(r.outcome, r.http_status, r.error_code) for r in rows] == [
            ("cancelled", 499, "client_disconnected")
        ]
        standin.controls.gate.set()
        await assert_everything_released(served)
        assert len(await audit_rows(served.state)) == 2


class _BrokenGuards:
    """A response-guard plug-in with a bug: opening a guard raises."""

    capabilities = GuardCapabilities()

    def open(self, info: Any) -> Any:
        raise RuntimeError("guard plug-in bug")


class _BrokenUpstream(Upstream):
    """An upstream path that raises what its contract says it never raises."""

    async def complete(self, call: UpstreamCall) -> UpstreamReply:
        raise LookupError("unexpected upstream failure")

    async def stream(self, call: UpstreamCall) -> UpstreamStream | UpstreamReply:
        raise LookupError("unexpected upstream failure")


@pytest.mark.parametrize("broken", ["guard", "upstream"])
@pytest.mark.parametrize("stream", [False, True])
async def test_an_unexpected_exception_after_admission_releases_everything(
    make_settings, standin, broken: str, stream: bool
) -> None:
    hooks = GatewayHooks(guards=_BrokenGuards()) if broken == "guard" else None
    async with served_gateway(_settings(make_settings, standin), standin, hooks) as served:
        healthy = served.state.direct
        if broken == "upstream":
            served.state.direct = _BrokenUpstream()  # type: ignore[assignment]
        r = await served.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "alpha beta gamma", "max_tokens": 3, "stream": stream},
            headers=bearer(served.key),
        )
        if stream and broken == "guard":
            # the stream had started: it ends with an error event, never a truncated 200
            assert r.status_code == 200
            events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
            assert json.loads(events[-1])["error"]["code"] == "internal_error"
            assert "[DONE]" not in events
        else:
            assert r.status_code == 500
            assert r.json()["error"]["code"] == "internal_error"
        assert "guard plug-in bug" not in r.text and "unexpected upstream" not in r.text
        assert in_flight(served) == (0, 0, 0.0)
        rows = await audit_rows(served.state)
        assert [(row.outcome, row.http_status, row.error_code) for row in rows] == [
            ("failed", 500, "internal_error")
        ]
        assert rows[0].request_id == r.headers["x-kvguard-request-id"]
        served.state.direct = healthy
        served.state.hooks.guards = GatewayHooks().guards
        await assert_everything_released(served)
