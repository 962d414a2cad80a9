"""The engine's span joins the gateway's trace, end to end: a REAL bundled engine process exports
its spans over OTLP/HTTP (``KVGUARD_OTLP_ENDPOINT``) to a receiver in this test (a real HTTP server
on 127.0.0.1 decoding the OTLP protobuf), the gateway exports to an in-memory exporter, and the
engine's span must be the child of the gateway's request span, with ids and no content."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from gateway_harness import bearer, running_gateway
from gateway_standin import serve
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvguard.testing import launch_engine

pytestmark = pytest.mark.slow


class OtlpReceiver:
    """An OTLP/HTTP trace collector that keeps every span it is sent (a test's collector)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service name, span)

        async def traces(request: Request) -> Response:
            export = ExportTraceServiceRequest.FromString(await request.body())
            for resource_spans in export.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
            body = ExportTraceServiceResponse().SerializeToString()
            return Response(body, media_type="application/x-protobuf")

        self.app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[OtlpReceiver, str]]:
    collector = OtlpReceiver()
    running = await serve(collector.app)
    try:
        yield collector, running.url
    finally:
        await running.stop()


async def test_engine_span_is_a_child_of_the_gateway_span(
    receiver, tiny_checkpoint, make_settings
) -> None:
    collector, collector_url = receiver
    env = {"KVGUARD_OTLP_ENDPOINT": collector_url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    engine = await anyio.to_thread.run_sync(
        lambda: launch_engine(tiny_checkpoint, env=env, pool_tokens=512, page_size=16)
    )
    try:
        exporter = InMemorySpanExporter()
        settings = make_settings(engines=[{"name": "real", "base_url": engine.url}])
        async with running_gateway(settings, span_exporter=exporter) as gw:
            tenant_id, key = await gw.create_tenant("acme")
            model = (await gw.client.get("/v1/models", headers=bearer(key))).json()["data"][0]
            body = {"model": model["id"], "prompt": "secret words", "max_tokens": 3}
            r = await gw.client.post("/v1/completions", headers=bearer(key), json=body)
            assert r.status_code == 200, r.text
            request_id = r.headers["x-kvguard-request-id"]
            deadline = time.monotonic() + 30
            while not any(s.name == "engine /v1/completions" for _, s in collector.spans):
                assert time.monotonic() < deadline, "the engine exported no request span"
                await asyncio.sleep(0.05)
    finally:
        await anyio.to_thread.run_sync(engine.stop)
    [gateway_span] = [s for s in exporter.get_finished_spans() if s.name == "gateway completions"]
    [(service, engine_span)] = [
        (svc, s) for svc, s in collector.spans if s.name == "engine /v1/completions"
    ]
    assert service == "kvguard-backend-unified"
    assert engine_span.trace_id.hex() == format(gateway_span.context.trace_id, "032x")
    assert engine_span.parent_span_id.hex() == format(gateway_span.context.span_id, "016x")
    attrs = {a.key: a.value for a in engine_span.attributes}
    assert attrs["kvguard.role"].string_value == "unified"
    assert attrs["http.response.status_code"].int_value == 200
    assert attrs["kvguard.request_id"].string_value == request_id
    assert attrs["kvguard.tenant_id"].string_value == tenant_id
    assert "secret" not in str(engine_span)
    # The engine's span lies inside the gateway's.
    assert gateway_span.start_time <= engine_span.start_time_unix_nano
    assert engine_span.end_time_unix_nano <= gateway_span.end_time
