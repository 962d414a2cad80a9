"""A client's trace context never reaches an engine: the gateway starts a trace of its own.

Attacker: a tenant that sends its own ``traceparent`` and ``tracestate`` with its requests, to
steer the engine's traces (join them to a trace id it chose, so its spans sit in the operator's
traces beside the engine's) or to smuggle free text (``tracestate`` is any vendor's opaque data)
through the gateway to the engine, which used to receive both verbatim.

Proves, with ``kvguard gateway`` as a real process in production mode (PostgreSQL, Redis, every
secret set) in front of a real ``kvguard backend unified`` process with its engine credential:
on every call the engine receives, streamed or not, the ``traceparent`` is the gateway's own (a
new trace id per request, never the client's trace or span id), no ``tracestate`` arrives, and
neither the client's ids nor its tracestate text appear in any header the engine is sent. The
spans the gateway exports show that ``traceparent`` is its engine-call span's, under a request
span with no parent that keeps the client's context only as a link (ids, no tracestate).

Between the gateway and the engine sits ``Recorder``, a pass-through on 127.0.0.1 that keeps the
headers of every request; the OTLP receiver is ``Collector``, a STAND-IN for the OpenTelemetry
Collector (a third party) that decodes the gateway's OTLP/HTTP exports.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from hostile_harness import serve_in_thread
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bench.fault_stack import Proc
from canary.config import new_key
from kvguard.testing import EngineProcess, launch_engine, wait_for

MODEL = "trace-tiny"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_STATE = "tenantvendor=smuggled-client-text"
CLIENT_CONTEXT = {
    "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    "tracestate": CLIENT_STATE,
}
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
HOP_BY_HOP = {"host", "content-length", "connection", "transfer-encoding"}


# -- what the engine receives ---------------------------------------------------------------------


@dataclass
class Recorder:
    """Passes every request through to the engine and keeps (method, path, headers) of each."""

    engine_url: str
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def completion_calls(self) -> list[dict[str, str]]:
        return [h for m, p, h in self.seen if m == "POST" and p.endswith("completions")]

    async def forward(self, request: Request) -> Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.seen.append((request.method, request.url.path, headers))
        outgoing = {k: v for k, v in headers.items() if k not in HOP_BY_HOP}
        client = httpx.AsyncClient(base_url=self.engine_url, timeout=60)
        upstream = client.build_request(
            request.method, request.url.path, headers=outgoing, content=await request.body()
        )
        answer = await client.send(upstream, stream=True)

        async def close() -> None:
            await answer.aclose()
            await client.aclose()

        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(
            answer.aiter_raw(), answer.status_code, kept, background=BackgroundTask(close)
        )

    def app(self) -> Starlette:
        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        return Starlette(routes=[Route("/{path:path}", self.forward, methods=methods)])


# -- what the gateway exports ---------------------------------------------------------------------


@dataclass(frozen=True)
class SeenSpan:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    links: tuple[tuple[str, str, str], ...]  # (trace id, span id, tracestate)


@dataclass
class Collector:
    """A STAND-IN for the OpenTelemetry Collector's OTLP/HTTP traces receiver."""

    spans: list[SeenSpan] = field(default_factory=list)

    async def traces(self, request: Request) -> Response:
        body = await request.body()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                self.spans += [_seen(span) for span in scope.spans]
        reply = ExportTraceServiceResponse().SerializeToString()
        return Response(reply, media_type="application/x-protobuf")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/traces", self.traces, methods=["POST"])])


def _seen(span: Any) -> SeenSpan:
    links = tuple((ln.trace_id.hex(), ln.span_id.hex(), ln.trace_state) for ln in span.links)
    ids = (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex())
    return SeenSpan(span.name, span.kind, *ids, links=links)


# -- the stack ------------------------------------------------------------------------------------


@dataclass
class Stack:
    gateway: Proc
    recorder: Recorder
    collector: Collector
    admin_token: str

    def tenant_key(self) -> str:
        r = httpx.post(
            self.gateway.url + "/admin/tenants",
            json={"name": "tracer"},
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )
        assert r.status_code == 201, r.text
        return str(r.json()["key"]["key"])


@pytest.fixture(scope="module")
def credentialed_engine(tiny_checkpoint: str) -> Iterator[tuple[EngineProcess, str]]:
    token = new_key()
    env = {"KVGUARD_SERVED_MODEL_NAME": MODEL, "KVGUARD_ENGINE_TOKEN": token}
    proc = launch_engine(tiny_checkpoint, pool_tokens=512, page_size=16, env=env)
    yield proc, token
    proc.stop()


def _gateway_env(
    postgres_url: str, redis_url: str, upstream_url: str, collector_url: str, data_dir: Path
) -> dict[str, str]:
    engine = {"name": "tiny", "kind": "bundled", "base_url": upstream_url}
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")},
        "KVGUARD_MODE": "production",
        "KVGUARD_DATA_DIR": str(data_dir),
        "KVGUARD_DATABASE_URL": postgres_url,
        "KVGUARD_REDIS_URL": redis_url,
        "KVGUARD_ENGINES": json.dumps([engine]),
        "KVGUARD_OTLP_ENDPOINT": collector_url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export spans within 0.1 s, not the SDK's 5 s
    }


@pytest.fixture
def stack(
    postgres_url: str,
    redis_url: str,
    credentialed_engine: tuple[EngineProcess, str],
    tmp_path: Path,
) -> Iterator[Stack]:
    engine, engine_token = credentialed_engine
    recorder, collector = Recorder(engine.url), Collector()
    admin_token = new_key()
    secrets = {
        "KVGUARD_ADMIN_TOKEN": admin_token,
        "KVGUARD_METRICS_TOKEN": new_key(),
        "KVGUARD_CANARY_KEY": new_key(),
        "KVGUARD_ENGINE_TOKEN": engine_token,
    }
    quiet: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "log_level": "warning"}
    with (
        serve_in_thread(uvicorn.Config(recorder.app(), **quiet)) as upstream_url,
        serve_in_thread(uvicorn.Config(collector.app(), **quiet)) as collector_url,
    ):
        env = _gateway_env(postgres_url, redis_url, upstream_url, collector_url, tmp_path / "data")
        env.update(secrets)
        gateway = Proc("gateway", ["gateway", "--log-level", "warning"], env, tmp_path / "gw.log")
        try:
            gateway.start().wait_healthy()  # healthy: it has polled the engine through us
            yield Stack(gateway, recorder, collector, admin_token)
        finally:
            gateway.stop()


# -- the attack -----------------------------------------------------------------------------------


def _ask(stack: Stack, key: str, *, stream: bool) -> None:
    headers = {"Authorization": f"Bearer {key}", **CLIENT_CONTEXT}
    if stream:
        path, body = "/v1/completions", {"prompt": "hi", "stream": True}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    body = {"model": MODEL, "max_tokens": 2, **body}
    r = httpx.post(stack.gateway.url + path, json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]


def test_a_clients_trace_context_never_reaches_the_engine(stack: Stack) -> None:
    key = stack.tenant_key()
    _ask(stack, key, stream=False)
    _ask(stack, key, stream=True)

    calls = stack.recorder.completion_calls()
    assert len(calls) == 2, [(m, p) for m, p, _ in stack.recorder.seen]
    ours = []
    for headers in calls:
        assert "tracestate" not in headers, headers["tracestate"]
        match = TRACEPARENT.fullmatch(headers.get("traceparent", ""))
        assert match is not None, headers.get("traceparent")
        assert match[1] != CLIENT_TRACE and match[2] != CLIENT_SPAN, match[0]
        ours.append((match[1], match[2]))
    assert len({trace for trace, _ in ours}) == 2  # a new trace per request
    for method, path, headers in stack.recorder.seen:  # the poller's calls included
        sent = repr(headers)
        for secret in (CLIENT_TRACE, CLIENT_SPAN, CLIENT_STATE, "smuggled-client-text"):
            assert secret not in sent, (method, path, secret)

    # The traceparent the engine got is the gateway's engine-call span, in a trace of its own.
    def exported() -> bool:
        ids = {(s.trace_id, s.span_id) for s in stack.collector.spans}
        return all(call in ids for call in ours)

    wait_for(exported, 30, "the gateway's spans of both engine calls")
    by_id = {span.span_id: span for span in stack.collector.spans}
    for trace, span_id in ours:
        call = by_id[span_id]
        assert (call.trace_id, call.kind) == (trace, SpanProto.SPAN_KIND_CLIENT), call
        request = by_id[call.parent_span_id]
        assert request.kind == SpanProto.SPAN_KIND_SERVER and not request.parent_span_id, request
        assert request.links == ((CLIENT_TRACE, CLIENT_SPAN, ""),), request.links
