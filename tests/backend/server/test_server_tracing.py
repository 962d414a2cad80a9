"""The engine's tracing middleware on a small ASGI app: which requests get a span, its parent, when
it ends (after the last streamed byte), its status, and nothing when no exporter is configured.
The handoff's CLIENT span around decode's real prefill channel, with its HTTP attributes, against
a server on 127.0.0.1 that answers 503 and a port nothing listens on.
(The real engine process joining the gateway's trace: tests/gateway/test_gateway_engine_trace_e2e.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from backend.disagg.errors import PrefillUnavailable
from backend.disagg.protocol import PROTOCOL_VERSION
from backend.server.prefill_client import HttpPrefillChannel
from backend.server.tracing import HANDOFF_HOOKS, HandoffTraces, install_tracing, tracer_provider
from kvguard.localservices import free_port
from kvguard.testing import serve
from tests.backend.disagg.disagg_messages import request as prefill_request

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def _app(exporter: InMemorySpanExporter | None) -> FastAPI:
    app = FastAPI()
    chunks_sent: list[int] = []

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for n in range(3):
                chunks_sent.append(n)
                # The span must still be open while the stream is running.
                assert exporter is None or exporter.get_finished_spans() == ()
                yield b"data: x\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        return JSONResponse({"error": "boom"}, status_code=503)

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    install_tracing(app, role="decode", otlp_endpoint=None, exporter=exporter)
    return app


async def _post(app: FastAPI, path: str, headers: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        return await client.post(path, headers=headers, json={})


async def test_a_request_span_is_the_child_of_the_callers_and_covers_the_stream() -> None:
    exporter = InMemorySpanExporter()
    app = _app(exporter)
    headers = {
        "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
        "X-Kvguard-Request-Id": "req-1",
        "X-Kvguard-Tenant": "tn-1",
    }
    r = await _post(app, "/v1/completions", headers)
    assert r.status_code == 200 and r.text == "data: x\n\n" * 3
    [span] = exporter.get_finished_spans()
    assert span.name == "POST /v1/completions"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID
    assert dict(span.attributes or {}) == {
        "kvguard.role": "decode",
        "http.request.method": "POST",
        "http.route": "/v1/completions",
        "kvguard.request_id": "req-1",
        "kvguard.tenant_id": "tn-1",
        "http.response.status_code": 200,
    }
    assert span.status.is_ok


async def test_server_errors_mark_the_span_and_other_paths_get_none() -> None:
    exporter = InMemorySpanExporter()
    app = _app(exporter)
    assert (await _post(app, "/v1/chat/completions", {})).status_code == 503
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        assert (await client.get("/health")).status_code == 200
    [span] = exporter.get_finished_spans()
    assert span.name == "POST /v1/chat/completions"
    assert span.parent is None  # no traceparent: a root span
    assert not span.status.is_ok
    assert dict(span.attributes or {})["error.type"] == "503"


def test_no_exporter_and_no_endpoint_installs_nothing() -> None:
    app = FastAPI()
    assert install_tracing(app, role="unified", otlp_endpoint=None) is None
    assert app.user_middleware == []


def test_a_handoff_span_is_the_child_of_its_decode_request_and_is_current() -> None:
    """What the driver wraps around a prefill call: a CLIENT span under the request's span,
    current while the call runs (so the channel's propagator sends it); nothing for a request
    whose span is not known (tracing was off, or another tenant's request id)."""
    exporter = InMemorySpanExporter()
    provider = tracer_provider("t", otlp_endpoint=None, exporter=exporter)
    assert provider is not None
    traces = HandoffTraces(provider)
    request = provider.get_tracer("t").start_span("POST /v1/completions")
    traces.remember("req-1", "tn-1", request.get_span_context())
    sent: dict[str, str] = {}
    with traces.handoff("req-1", "tn-1"):
        TraceContextTextMapPropagator().inject(sent)
    [handoff] = exporter.get_finished_spans()
    assert (handoff.name, handoff.kind.name) == ("kv handoff", "CLIENT")
    assert handoff.parent is not None
    assert handoff.parent.span_id == request.get_span_context().span_id
    assert sent["traceparent"].split("-")[2] == format(handoff.context.span_id, "016x")
    for request_id, tenant in (("req-1", "tn-2"), ("req-2", "tn-1")):
        with traces.handoff(request_id, tenant):
            assert not trace.get_current_span().get_span_context().is_valid
    traces.forget("req-1", "tn-1")
    with traces.handoff("req-1", "tn-1"):
        assert not trace.get_current_span().get_span_context().is_valid
    assert len(exporter.get_finished_spans()) == 1


async def _traced_prefill(base_url: str) -> tuple[Any, BaseException]:
    """One handoff over decode's real channel and a client with ``HANDOFF_HOOKS``, inside its
    span; returns the finished span and what the call raised."""
    exporter = InMemorySpanExporter()
    provider = tracer_provider("t", otlp_endpoint=None, exporter=exporter)
    assert provider is not None
    traces = HandoffTraces(provider)
    request = provider.get_tracer("t").start_span("POST /v1/completions")
    traces.remember("req-1", "tn-1", request.get_span_context())
    async with httpx.AsyncClient(event_hooks=HANDOFF_HOOKS) as client:
        channel = HttpPrefillChannel(base_url, client, local_version=PROTOCOL_VERSION)
        # each caller asserts the exception's type
        with pytest.raises(Exception) as raised, traces.handoff("req-1", "tn-1"):
            await channel.prefill(prefill_request(), timeout_s=10)
    [handoff] = exporter.get_finished_spans()
    return handoff, raised.value


async def test_a_handoff_answered_with_an_error_status_carries_it_on_its_client_span() -> None:
    async def unavailable(request: Request) -> Response:
        return Response("busy", status_code=503)

    prefill = await serve(
        Starlette(routes=[Route("/kv/v1/prefill", unavailable, methods=["POST"])])
    )
    try:
        handoff, raised = await _traced_prefill(prefill.url)
    finally:
        await prefill.stop()
    assert isinstance(raised, PrefillUnavailable)
    port = int(prefill.url.rsplit(":", 1)[1])
    assert dict(handoff.attributes or {}) == {
        "http.request.method": "POST",
        "kvguard.request_id": "req-1",
        "server.address": "127.0.0.1",
        "server.port": port,
        "url.full": f"{prefill.url}/kv/v1/prefill",
        "http.response.status_code": 503,
        "error.type": "503",
    }
    assert not handoff.status.is_ok


async def test_a_handoff_that_gets_no_answer_names_the_exception_and_no_credentials() -> None:
    """A refused connection: no status code, ``error.type`` is the exception's class; a prefill
    URL holding credentials shows them as REDACTED in ``url.full``."""
    port = free_port()  # nothing listens there
    handoff, raised = await _traced_prefill(f"http://decode:hunter2@127.0.0.1:{port}")
    assert isinstance(raised, httpx.ConnectError)
    attributes = dict(handoff.attributes or {})
    assert attributes["url.full"] == f"http://REDACTED:REDACTED@127.0.0.1:{port}/kv/v1/prefill"
    assert (attributes["server.address"], attributes["server.port"]) == ("127.0.0.1", port)
    assert attributes["error.type"] == "httpx.ConnectError"
    assert "http.response.status_code" not in attributes
    assert "hunter2" not in str(handoff.to_json()) and not handoff.status.is_ok


async def test_the_hooks_leave_calls_outside_a_handoff_span_alone() -> None:
    """Decode's capacity polls and aborts use the same client, outside any handoff span."""
    exporter = InMemorySpanExporter()
    provider = tracer_provider("t", otlp_endpoint=None, exporter=exporter)
    assert provider is not None
    other = provider.get_tracer("t").start_span("something else")
    with trace.use_span(other, end_on_exit=True):
        async with httpx.AsyncClient(event_hooks=HANDOFF_HOOKS) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{free_port()}/engine/capacity")
    [span] = exporter.get_finished_spans()
    assert dict(span.attributes or {}) == {}
