"""The canary on the real stack: the gateway (uvicorn on 127.0.0.1) with PostgreSQL and Redis in
front of the REAL bundled engine (``kvguard backend unified`` via ``engine_factory``), and the
``kvguard canary probe`` command run against it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import anyio
import pytest
import redis
from canary_harness import TEST_CANARY_KEY, bearer, canary_gateway, sse_text

from backend.bundled import chat
from canary.injection import inject_chat
from kvguard.cli import main

pytestmark = pytest.mark.slow
BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "backend" / "bundled" / "kvguard-tiny"
MESSAGES = [{"role": "user", "content": "Hello engine"}]


async def _engine(engine_factory, **options) -> str:
    return await anyio.to_thread.run_sync(lambda: engine_factory(**options))


def _marker_tokens() -> int:
    """Prompt tokens a marker adds on the byte tokenizer (a system message of one line)."""
    marked = inject_chat(MESSAGES, "C" * 37)
    return len(chat.render(marked).encode()) - len(chat.render(MESSAGES).encode())


async def _prompt_tokens(gw, key: str, stream: bool) -> tuple[int, str]:
    body = {"model": gw.model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0.0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    r = await gw.client.post("/v1/chat/completions", headers=bearer(key), json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]["prompt_tokens"], r.text
    usage = [
        json.loads(block[6:])["usage"]
        for block in r.text.split("\n\n")
        if block.startswith("data: {") and '"usage"' in block and '"choices":[]' in block
    ]
    assert sse_text(r.content)[1] == []
    return usage[0]["prompt_tokens"], r.text


async def test_markers_are_injected_at_the_sampled_rate_and_never_returned(
    engine_factory, gateway_settings, canary_settings, postgres_url, redis_url
) -> None:
    url = await _engine(engine_factory, pool_tokens=1024, page_size=16, context_window=1024)
    settings = gateway_settings(
        database_url=postgres_url, redis_url=redis_url, engines=[{"name": "real", "base_url": url}]
    )
    async with canary_gateway(settings, canary_settings(), random=random.Random(3).random) as gw:
        gw.model = (await gw.client.get("/admin/engines", headers=gw.admin)).json()[0]["model"]
        _, plain_key = await gw.create_tenant("plain")
        tenant_id, key = await gw.create_tenant("sampled", canary_sample_rate=0.5)
        base, _ = await _prompt_tokens(gw, plain_key, stream=False)
        rng = random.Random(3)
        expected = [rng.random() < 0.5 for _ in range(12)]
        seen = []
        for i in range(12):
            tokens, raw = await _prompt_tokens(gw, key, stream=i % 2 == 1)
            assert "CNRY" not in raw
            seen.append(tokens)
        # The tenant never sees (nor pays for) the marker's tokens: its usage is its own.
        assert seen == [base] * 12
        assert 3 < sum(expected) < 9
        for _ in range(500):  # the audit rows land within a flush or two
            usage = (await gw.client.get("/v1/usage", headers=bearer(key))).json()
            if usage["requests"] == 12:
                break
            await anyio.sleep(0.02)
        assert (usage["requests"], usage["prompt_tokens"]) == (12, 12 * base)

        await gw.runtime.injector.drain()
        client = redis.Redis.from_url(redis_url)
        keys = client.keys("kvguard:canary:marker:*")
        records = [json.loads(client.get(k)) for k in keys]
        assert len(records) == sum(expected)
        assert {(r["tenant_id"], r["engine"]) for r in records} == {(tenant_id, "real")}
        metrics = await gw.metrics()
        injected = (
            f'kvguard_canary_markers_injected_total{{tenant="{tenant_id}"}} {sum(expected)}.0'
        )
        assert injected in metrics
        unmarked = f'kvguard_canary_requests_total{{marked="false",tenant="{tenant_id}"}}'
        assert f"{unmarked} {12 - sum(expected)}.0" in metrics
        assert await gw.findings() == []  # the engine's counts match the gateway's exactly


async def test_a_sampled_tenant_is_limited_for_its_own_tokens_and_capacity_counts_all(
    engine_factory, gateway_settings, canary_settings
) -> None:
    """tokens/min exactly the tenant's own prompt + max_tokens: admitted with the marker (which
    adds ``_marker_tokens()`` the engine reads); the request counts its real size for capacity:
    with a pool that holds the prompt without the marker only, it is sent unmarked."""
    url = await _engine(engine_factory, pool_tokens=1024, page_size=16, context_window=1024)
    settings = gateway_settings(engines=[{"name": "real", "base_url": url}])
    async with canary_gateway(settings, canary_settings()) as gw:
        gw.model = (await gw.client.get("/admin/engines", headers=gw.admin)).json()[0]["model"]
        _, plain_key = await gw.create_tenant("plain")
        base, _ = await _prompt_tokens(gw, plain_key, stream=False)
        fields = {"canary_sample_rate": 1.0, "tokens_per_minute": base + 4}
        tenant_id, key = await gw.create_tenant("budget", **fields)
        tokens, _ = await _prompt_tokens(gw, key, stream=False)
        assert tokens == base
        metrics = await gw.metrics()
        assert f'kvguard_canary_markers_injected_total{{tenant="{tenant_id}"}} 1.0' in metrics
        # The engine read the marker: the canary's usage check (engine vs gateway count) agrees.
        assert await gw.findings() == []
        # Capacity: own prompt + max_tokens == the pool: it fits only without the marker.
        body = {"model": gw.model, "messages": MESSAGES, "max_tokens": 1024 - base}
        r = await gw.client.post("/v1/chat/completions", headers=bearer(plain_key), json=body)
        assert r.status_code == 200, r.text
        _, big_key = await gw.create_tenant("big", canary_sample_rate=1.0)
        r = await gw.client.post("/v1/chat/completions", headers=bearer(big_key), json=body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == base, r.text


async def _probe(argv: list[str]) -> int:
    return await anyio.to_thread.run_sync(lambda: main(argv))


async def test_probe_command_against_a_running_gateway(
    engine_factory, gateway_settings, canary_settings, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("KVGUARD_CANARY_KEY", TEST_CANARY_KEY)
    bundled = BUNDLED_MODEL.is_dir()
    options = {"model": str(BUNDLED_MODEL)} if bundled else {}
    url = await _engine(
        engine_factory, pool_tokens=512, page_size=16, context_window=512, **options
    )
    settings = gateway_settings(engines=[{"name": "real", "base_url": url}])
    async with canary_gateway(settings, canary_settings()) as gw:
        status = await _probe(
            ["canary", "probe", "--gateway", gw.url, "--once", "--kind", "capacity"]
        )
        table = capsys.readouterr().out
        assert status == 0, table
        assert "4/4 passed" in table
        for label in ("limit-1: 511 of 512", "limit: 512 of 512", "limit+1: 513 of 512"):
            assert label in table
        runs = (await gw.client.get("/admin/canary/probe-runs", headers=gw.admin)).json()
        assert [(r["kind"], r["passed"]) for r in runs] == [("capacity", True)] * 4
        assert [r["observed"] for r in runs][::-1] == ["200", "200"] + [
            "400 context_length_exceeded"
        ] * 2
        assert {r["engine"] for r in runs[2:]} == {"real"}  # the 200s name the engine

        status = await _probe(["canary", "probe", "--gateway", gw.url, "--once"])
        table = capsys.readouterr().out
        rows = {line.split()[0]: line for line in table.splitlines()[2:-1]}
        assert {"echo", "capacity", "cross_tenant", "abort"} <= set(rows)
        for kind in ("cross_tenant", "abort"):
            assert " PASS " in rows[kind], table  # no marker of A in B's answer
        if bundled:
            assert status == 0 and " PASS " in rows["echo"], table
        else:
            # The random test checkpoint copies nothing: the echo probe must fail, and say why.
            assert status == 1 and " FAIL " in rows["echo"] and "own marker missing" in table
        metrics = await gw.metrics()
        assert (
            'kvguard_canary_probe_results_total{engine="real",kind="cross_tenant",result="pass"}'
            in metrics
        )
        assert await gw.findings() == []
        tenants = (await gw.client.get("/admin/tenants", headers=gw.admin)).json()
        assert {(t["name"], t["synthetic"]) for t in tenants} == {
            ("canary-probe-a", True),
            ("canary-probe-b", True),
        }
