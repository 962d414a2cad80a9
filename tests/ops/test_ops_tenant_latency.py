"""Per-tenant TTFT and inter-token latency: exact observation counts per response path.

The gateway runs in process and routes to the gateway tests' STAND-IN engine (a real HTTP server
that streams one SSE event per answer word), so the number of text events is known exactly: a
streamed answer of N words is one TTFT and N - 1 gaps for its tenant, a non-streamed answer one
TTFT under ``stream="false"`` and no gap. Series are labelled by tenant id, never by content.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from gateway_harness import Gateway, bearer, running_gateway
from gateway_standin import MODEL, StandInControls, start_standin

from gateway.config import GatewaySettings
from gateway.metrics import INTER_TOKEN_SECONDS, TENANT_TTFT_SECONDS

WORDS = "alpha bravo charlie delta echo"


@pytest.fixture
async def gateway(sqlite_url: str) -> AsyncIterator[Gateway]:
    engine = await start_standin(StandInControls())
    settings = GatewaySettings(
        database_url=sqlite_url,
        poll_interval_s=30.0,
        capacity_stale_after_s=60.0,
        audit_flush_interval_s=0.05,
        engines=[{"name": "standin", "kind": "bundled", "base_url": engine.url}],
    )
    try:
        async with running_gateway(settings) as gw:
            yield gw
    finally:
        await engine.stop()


def _count(gw: Gateway, name: str, **labels: str) -> float:
    value = gw.state.metrics.registry.get_sample_value(name + "_count", labels)
    return 0.0 if value is None else value


def _text_events(raw: bytes) -> int:
    """SSE events of the body that carry answer text (what the client received)."""
    count = 0
    for block in raw.decode().split("\n\n"):
        data = block.removeprefix("data: ").strip()
        if not data.startswith("{"):
            continue
        choices: list[dict[str, Any]] = json.loads(data).get("choices") or []
        count += any(c.get("text") for c in choices)
    return count


async def test_a_stream_observes_one_ttft_and_one_gap_per_later_token(gateway: Gateway) -> None:
    tenant, key = await gateway.create_tenant("acme")
    other, _ = await gateway.create_tenant("globex")
    body = {"model": MODEL, "prompt": WORDS, "max_tokens": 5, "stream": True}
    r = await gateway.client.post("/v1/completions", json=body, headers=bearer(key))
    assert r.status_code == 200, r.text
    chunks = _text_events(r.content)
    assert chunks == len(WORDS.split())
    assert _count(gateway, TENANT_TTFT_SECONDS, tenant=tenant, stream="true") == 1
    assert _count(gateway, TENANT_TTFT_SECONDS, tenant=tenant, stream="false") == 0
    assert _count(gateway, INTER_TOKEN_SECONDS, tenant=tenant) == chunks - 1
    assert _count(gateway, TENANT_TTFT_SECONDS, tenant=other, stream="true") == 0
    gaps = gateway.state.metrics.registry.get_sample_value(
        INTER_TOKEN_SECONDS + "_sum", {"tenant": tenant}
    )
    ttft = gateway.state.metrics.registry.get_sample_value(
        TENANT_TTFT_SECONDS + "_sum", {"tenant": tenant, "stream": "true"}
    )
    assert gaps is not None and gaps >= 0 and ttft is not None and ttft > 0
    exposed = (await gateway.client.get("/metrics")).text
    assert f'{TENANT_TTFT_SECONDS}_count{{stream="true",tenant="{tenant}"}} 1.0' in exposed
    assert all(word not in exposed for word in WORDS.split())


async def test_a_whole_answer_observes_its_ttft_and_no_gap(gateway: Gateway) -> None:
    tenant, key = await gateway.create_tenant("acme")
    body = {"model": MODEL, "prompt": WORDS, "max_tokens": 5}
    r = await gateway.client.post("/v1/completions", json=body, headers=bearer(key))
    assert r.status_code == 200, r.text
    assert _count(gateway, TENANT_TTFT_SECONDS, tenant=tenant, stream="false") == 1
    assert _count(gateway, TENANT_TTFT_SECONDS, tenant=tenant, stream="true") == 0
    assert _count(gateway, INTER_TOKEN_SECONDS, tenant=tenant) == 0


async def test_a_refused_request_observes_no_latency(gateway: Gateway) -> None:
    tenant, key = await gateway.create_tenant("acme")
    body = {"model": MODEL, "prompt": "word " * 5000, "max_tokens": 5, "stream": True}
    r = await gateway.client.post("/v1/completions", json=body, headers=bearer(key))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    for stream in ("true", "false"):
        assert _count(gateway, TENANT_TTFT_SECONDS, tenant=tenant, stream=stream) == 0
    assert _count(gateway, INTER_TOKEN_SECONDS, tenant=tenant) == 0
