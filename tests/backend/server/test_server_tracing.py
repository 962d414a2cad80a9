"""The engine's tracing middleware on a small ASGI app: which requests get a span, its parent, when
it ends (after the last streamed byte), its status, and nothing when no exporter is configured.
(The real engine process joining the gateway's trace: tests/gateway/test_gateway_engine_trace_e2e.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from backend.server.tracing import HandoffTraces, install_tracing, tracer_provider

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
