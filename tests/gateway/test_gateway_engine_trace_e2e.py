"""One trace from the gateway through decode to prefill, end to end: the gateway and REAL bundled
prefill and decode processes export their spans over OTLP/HTTP (``KVGUARD_OTLP_ENDPOINT``) to a
receiver in this test (a real HTTP server on 127.0.0.1 decoding the OTLP protobuf). The chain must
be gateway SERVER -> gateway CLIENT (the engine call, GenAI attributes) -> decode SERVER -> decode
CLIENT (``kv handoff``, HTTP client attributes: where it went and what it got) -> prefill SERVER
(``/kv/v1/prefill``), one trace id, ids and counts only (no prompt, no completion).

Times: every span starts after its parent (a call is made before it is received). Only a parent in
the same process is promised to end after its child (the gateway closes its engine call's span
before the request's; decode's handoff is over before decode answers). A CLIENT span's SERVER child
in another process may end after it: the engine closes its span once it has sent the last bytes,
and the caller may have read them and closed its own span first (OpenTelemetry orders nothing
across processes)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
from gateway_harness import bearer, running_gateway
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvguard.testing import launch_engine, serve

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


def _attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        value = a.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[a.key] = tuple(v.string_value for v in value.array_value.values)
        else:
            out[a.key] = getattr(value, kind)
    return out


def _launch_pair(model: str, env: dict[str, str]) -> tuple[Any, Any]:
    prefill = launch_engine(model, role="prefill", env=env, pool_tokens=512, page_size=16)
    try:
        decode = launch_engine(
            model, role="decode", env=env, pool_tokens=512, page_size=16, prefill_url=prefill.url
        )
    except BaseException:
        prefill.stop()
        raise
    return prefill, decode


async def _wait_until(check: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_one_trace_from_the_gateway_through_decode_to_prefill(
    receiver, tiny_checkpoint, make_settings, monkeypatch
) -> None:
    collector, collector_url = receiver
    env = {"KVGUARD_OTLP_ENDPOINT": collector_url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the gateway's batch processor too
    prefill, decode = await anyio.to_thread.run_sync(lambda: _launch_pair(tiny_checkpoint, env))
    try:
        await _wait_until(
            lambda: httpx.get(decode.url + "/engine/capacity").json().get("unavailable") is None,
            "decode reached its prefill",
        )
        settings = make_settings(
            engines=[{"name": "real", "base_url": decode.url}], otlp_endpoint=collector_url
        )
        async with running_gateway(settings) as gw:
            tenant_id, key = await gw.create_tenant("acme")
            model = (await gw.client.get("/v1/models", headers=bearer(key))).json()["data"][0]
            body = {"model": model["id"], "prompt": "secret words", "max_tokens": 3}
            r = await gw.client.post("/v1/completions", headers=bearer(key), json=body)
            assert r.status_code == 200, r.text
            request_id = r.headers["x-kvguard-request-id"]
        names = {"POST /v1/completions", "kv handoff", "POST /kv/v1/prefill"}
        await _wait_until(
            lambda: names <= {s.name for _, s in collector.spans}, "every hop exported"
        )
    finally:
        await anyio.to_thread.run_sync(decode.stop)
        await anyio.to_thread.run_sync(prefill.stop)
    by_service: dict[str, list[Any]] = {}
    for service, span in collector.spans:
        by_service.setdefault(service, []).append(span)
    gateway = {s.name: s for s in by_service["kvguard-gateway"]}
    [server, call] = gateway["POST /v1/completions"], gateway[f"text_completion {model['id']}"]
    [decode_server] = [s for s in by_service["kvguard-backend-decode"] if s.kind == 2]
    [handoff] = [s for s in by_service["kvguard-backend-decode"] if s.name == "kv handoff"]
    [prefill_server] = by_service["kvguard-backend-prefill"]
    chain = [server, call, decode_server, handoff, prefill_server]
    hops = zip(chain, ["gateway", "gateway", "decode", "decode", "prefill"], strict=True)
    assert {s.trace_id for s in chain} == {server.trace_id}
    for (parent, where), (child, child_where) in itertools.pairwise(hops):
        assert child.parent_span_id == parent.span_id, (parent.name, child.name)
        assert parent.start_time_unix_nano <= child.start_time_unix_nano
        if child_where == where:
            assert child.end_time_unix_nano <= parent.end_time_unix_nano, (parent.name, child.name)
    assert [s.kind for s in chain] == [2, 3, 2, 3, 2]  # SERVER, CLIENT, ...
    assert decode_server.name == "POST /v1/completions"
    attrs = _attrs(call)
    assert (attrs["gen_ai.operation.name"], attrs["gen_ai.request.model"]) == (
        "text_completion",
        model["id"],
    )
    assert attrs["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert attrs["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == (r.json()["choices"][0]["finish_reason"],)
    assert _attrs(server)["kvguard.tenant_id"] == tenant_id
    decode_attrs = _attrs(decode_server)
    assert (decode_attrs["kvguard.role"], decode_attrs["kvguard.request_id"]) == (
        "decode",
        request_id,
    )
    assert _attrs(prefill_server)["http.response.status_code"] == 200
    prefill_url = urlsplit(prefill.url)
    assert _attrs(handoff) == {  # OpenTelemetry's HTTP client span, and the request it carries
        "http.request.method": "POST",
        "server.address": prefill_url.hostname,
        "server.port": prefill_url.port,
        "url.full": prefill.url + "/kv/v1/prefill",
        "http.response.status_code": 200,
        "kvguard.request_id": request_id,
    }
    for span in chain:
        assert "secret" not in str(span)
