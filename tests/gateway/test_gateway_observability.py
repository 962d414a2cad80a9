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


async def test_spans_with_ids_and_propagation(make_settings, standin) -> None:
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
    assert [span.name for span in spans] == ["gateway completions"] * 2
    ok, missing = spans
    attrs = dict(ok.attributes or {})
    assert attrs["kvguard.tenant_id"] == tenant_id
    assert attrs["kvguard.engine"] == "s"
    assert (attrs["kvguard.prompt_tokens"], attrs["kvguard.completion_tokens"]) == (2, 2)
    assert (attrs["kvguard.outcome"], attrs["http.response.status_code"]) == ("completed", 200)
    assert "secret" not in repr(attrs)
    traceparent = standin.controls.seen_headers[-1]["traceparent"]
    assert traceparent.split("-")[1] == format(ok.context.trace_id, "032x")
    assert traceparent.split("-")[2] == format(ok.context.span_id, "016x")
    assert dict(missing.attributes or {})["kvguard.error_code"] == "model_not_found"
