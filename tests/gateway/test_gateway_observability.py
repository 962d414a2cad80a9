"""Prometheus metrics (tenant ids, never content) and OpenTelemetry spans propagated to the
engine."""

from __future__ import annotations

from gateway_harness import bearer, running_gateway
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.metrics import METRIC_NAMES

MODEL = "standin-model"


async def test_metrics_carry_ids_not_content(gateway) -> None:
    tenant_id, key = await gateway.create_tenant("acme", requests_per_minute=1)
    body = {"model": MODEL, "prompt": "zebra quokka narwhal", "max_tokens": 3}
    assert (
        await gateway.client.post("/v1/completions", json=body, headers=bearer(key))
    ).status_code == 200
    assert (
        await gateway.client.post("/v1/completions", json=body, headers=bearer(key))
    ).status_code == 429
    text = (await gateway.client.get("/metrics")).text
    for word in ("zebra", "quokka", "narwhal"):
        assert word not in text
    assert (
        f'kvguard_gateway_requests_total{{code="",endpoint="completions",outcome="completed",'
        f'tenant="{tenant_id}"}} 1.0'
    ) in text
    assert (
        f'kvguard_gateway_requests_total{{code="rate_limit_exceeded",endpoint="completions",'
        f'outcome="rejected",tenant="{tenant_id}"}} 1.0'
    ) in text
    assert f'kvguard_gateway_tokens_total{{kind="prompt",tenant="{tenant_id}"}} 3.0' in text
    assert f'kvguard_gateway_tokens_total{{kind="completion",tenant="{tenant_id}"}} 3.0' in text
    assert (
        f'kvguard_gateway_rate_limited_total{{limit="requests",tenant="{tenant_id}"}} 1.0' in text
    )
    assert "kvguard_gateway_limiter_up 1.0" in text
    exposed = {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line.startswith("kvguard_")
    }
    expected = {name for name in METRIC_NAMES}
    families = {
        n.removesuffix("_bucket")
        .removesuffix("_count")
        .removesuffix("_sum")
        .removesuffix("_created")
        for n in exposed
    }
    assert families <= expected | {n.removesuffix("_total") for n in expected}


CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def test_spans_follow_the_genai_and_http_conventions(make_settings, standin) -> None:
    """A SERVER span per request and a CLIENT span per engine call, whose context alone reaches
    the engine; GenAI and HTTP attributes, ids, never content."""
    exporter = InMemorySpanExporter()
    settings = make_settings(engines=[{"name": "s", "base_url": standin.url}])
    async with running_gateway(settings, span_exporter=exporter) as gw:
        tenant_id, key = await gw.create_tenant("acme")
        r = await gw.client.post(
            "/v1/completions",
            headers=bearer(key),
            json={"model": MODEL, "prompt": "secret words", "max_tokens": 2},
        )
        assert r.status_code == 200
        refused = await gw.client.post(
            "/v1/completions",
            headers=bearer(key),
            json={"model": "nope", "prompt": "x", "max_tokens": 2},
        )
        assert refused.status_code == 404
    spans = exporter.get_finished_spans()
    assert [(s.name, s.kind.name) for s in spans] == [
        (f"text_completion {MODEL}", "CLIENT"),
        ("POST /v1/completions", "SERVER"),
        ("POST /v1/completions", "SERVER"),
    ]
    call, ok, missing = spans
    assert call.parent is not None and call.parent.span_id == ok.context.span_id
    attrs = dict(ok.attributes or {})
    assert attrs["kvguard.tenant_id"] == tenant_id
    assert attrs["kvguard.engine"] == "s"
    assert (attrs["http.request.method"], attrs["http.route"]) == ("POST", "/v1/completions")
    assert (attrs["gen_ai.operation.name"], attrs["gen_ai.request.model"]) == (
        "text_completion",
        MODEL,
    )
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (2, 2)
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)
    assert (attrs["kvguard.outcome"], attrs["http.response.status_code"]) == ("completed", 200)
    client = dict(call.attributes or {})
    port = int(standin.url.rsplit(":", 1)[1])
    assert client == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "bundled",
        "gen_ai.request.model": MODEL,
        "gen_ai.request.max_tokens": 2,
        "http.request.method": "POST",
        "server.address": "127.0.0.1",
        "server.port": port,
        "url.full": standin.url + "/v1/completions",
        "gen_ai.usage.input_tokens": 2,
        "gen_ai.usage.output_tokens": 2,
        "gen_ai.response.finish_reasons": ("stop",),
    }
    assert "secret" not in repr(attrs) + repr(client)
    traceparent = standin.controls.seen_headers[-1]["traceparent"]
    assert traceparent.split("-")[1] == format(call.context.trace_id, "032x")
    assert traceparent.split("-")[2] == format(call.context.span_id, "016x")
    assert dict(missing.attributes or {})["kvguard.error_code"] == "model_not_found"


async def test_a_clients_trace_context_never_reaches_the_engine(make_settings, standin) -> None:
    """The gateway starts its own trace (the client's becomes a link, ids only): the engine
    never sees the client's traceparent or tracestate."""
    exporter = InMemorySpanExporter()
    settings = make_settings(engines=[{"name": "s", "base_url": standin.url}])
    async with running_gateway(settings, span_exporter=exporter) as gw:
        _, key = await gw.create_tenant("acme")
        client_context = {
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
            "tracestate": "vendor=opaque-client-data",
        }
        r = await gw.client.post(
            "/v1/completions",
            headers={**bearer(key), **client_context},
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        )
        assert r.status_code == 200
    seen = standin.controls.seen_headers[-1]
    assert CLIENT_TRACE not in seen["traceparent"] and "tracestate" not in seen
    assert "opaque-client-data" not in repr(seen)
    server = next(s for s in exporter.get_finished_spans() if s.kind.name == "SERVER")
    assert server.parent is None
    assert format(server.context.trace_id, "032x") != CLIENT_TRACE
    (link,) = server.links
    assert format(link.context.trace_id, "032x") == CLIENT_TRACE
    assert format(link.context.span_id, "016x") == CLIENT_SPAN
    assert not link.context.trace_state


def test_an_unexported_engine_call_carries_the_traceparent_the_propagator_writes() -> None:
    """Without an exporter the engine's ``traceparent`` is formatted directly (no ``Context``
    per request): the same header OpenTelemetry's propagator writes, and the client's
    ``tracestate`` is never passed on."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from gateway.tracing import Tracing

    tracing = Tracing(service_name="t", otlp_endpoint=None)
    request = tracing.start_request("/v1/chat/completions", MODEL, {})
    headers = {"tracestate": "theirs=1"}
    child = tracing.start_upstream(
        request,
        base_url="http://127.0.0.1:1",
        route="/v1/chat/completions",
        provider="vllm",
        model=MODEL,
        max_tokens=3,
        headers=headers,
    )
    expected: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(expected, context=trace.set_span_in_context(child))
    assert headers == expected
    context = child.get_span_context()
    assert context.trace_id == request.get_span_context().trace_id
    assert context.span_id != request.get_span_context().span_id
