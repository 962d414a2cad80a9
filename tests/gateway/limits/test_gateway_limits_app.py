"""Tenant limits through the gateway: exact across several app instances sharing Redis, 429 with
Retry-After, fail closed (503) when Redis is down, concurrency released on every exit path
(engine unreachable, client disconnect mid-stream). Upstream: the stand-in engine."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import redis
from gateway_harness import bearer, running_gateway

from gateway.app import create_app
from kvguard.localservices import free_port
from kvguard.testing import serve

BODY = {"model": "standin-model", "prompt": "one two three four", "max_tokens": 4}


def _engines(standin):
    return [{"name": "standin", "kind": "bundled", "base_url": standin.url}]


@contextlib.asynccontextmanager
async def _apps(make_settings, standin, count: int, **overrides):
    async with contextlib.AsyncExitStack() as stack:
        apps = []
        for _ in range(count):
            settings = make_settings(engines=_engines(standin), **overrides)
            apps.append(await stack.enter_async_context(running_gateway(settings)))
        yield apps


async def test_rate_limit_exact_across_replicas(make_settings, standin, redis_url) -> None:
    async with _apps(make_settings, standin, 3, redis_url=redis_url) as apps:
        _, key = await apps[0].create_tenant("acme", requests_per_minute=6)
        responses = await asyncio.gather(
            *(
                apps[i % 3].client.post("/v1/completions", json=BODY, headers=bearer(key))
                for i in range(24)
            )
        )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 6 + [429] * 18
    limited = [r for r in responses if r.status_code == 429]
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in limited)
    assert all(1 <= int(r.headers["retry-after"]) <= 10 for r in limited)


async def test_tokens_per_minute_exact_and_refunded(make_settings, standin, redis_url) -> None:
    # each request charges 4 prompt + 4 max_tokens = 8; the engine echoes 4 words: 0 refunded
    async with _apps(make_settings, standin, 2, redis_url=redis_url) as apps:
        _, key = await apps[0].create_tenant("acme", tokens_per_minute=60)
        responses = await asyncio.gather(
            *(
                apps[i % 2].client.post("/v1/completions", json=BODY, headers=bearer(key))
                for i in range(20)
            )
        )
        assert sorted(r.status_code for r in responses) == [200] * 7 + [429] * 13
        # max_tokens 40 but the answer uses 4: 36 come back, so the next request still fits
        _, key2 = await apps[0].create_tenant("refund", tokens_per_minute=100)
        big = {**BODY, "max_tokens": 40}
        first = await apps[0].client.post("/v1/completions", json=big, headers=bearer(key2))
        second = await apps[1].client.post("/v1/completions", json=big, headers=bearer(key2))
        third = await apps[0].client.post("/v1/completions", json=big, headers=bearer(key2))
    assert [first.status_code, second.status_code, third.status_code] == [200, 200, 200]


async def test_concurrency_cap_is_exact_and_released(make_settings, standin, redis_url) -> None:
    standin.controls.gate = asyncio.Event()
    async with _apps(make_settings, standin, 2, redis_url=redis_url) as apps:
        tenant_id, key = await apps[0].create_tenant("acme", max_concurrency=2)
        tasks = [
            asyncio.create_task(
                apps[i % 2].client.post("/v1/completions", json=BODY, headers=bearer(key))
            )
            for i in range(7)
        ]
        for _ in range(200):
            if len(standin.controls.seen_bodies) == 2 and sum(t.done() for t in tasks) == 5:
                break
            await asyncio.sleep(0.01)
        refused = [t.result() for t in tasks if t.done()]
        assert [r.status_code for r in refused] == [429] * 5
        standin.controls.gate.set()
        pending = [t for t in tasks if t not in {t for t in tasks if t.done()}]
        admitted = await asyncio.gather(*pending)
        assert [r.status_code for r in admitted] == [200, 200]
        after = await apps[1].client.post("/v1/completions", json=BODY, headers=bearer(key))
        assert after.status_code == 200
    assert redis.Redis.from_url(redis_url).zcard(f"kvg:lim:{{{tenant_id}}}:leases") == 0


async def test_redis_down_fails_closed_for_limited_tenants(make_settings, standin) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with running_gateway(make_settings(engines=_engines(standin), redis_url=dead)) as gw:
        _, limited = await gw.create_tenant("limited", requests_per_minute=100)
        _, free = await gw.create_tenant("free")
        refused = await gw.client.post("/v1/completions", json=BODY, headers=bearer(limited))
        assert (refused.status_code, refused.json()["error"]["code"]) == (
            503,
            "limiter_unavailable",
        )
        ok = await gw.client.post("/v1/completions", json=BODY, headers=bearer(free))
        assert ok.status_code == 200
        health = await gw.client.get("/health")
        assert health.status_code == 503
        assert health.json()["limiter"] == {"backend": "redis", "ok": False}
        assert "limiter unreachable: limited tenants are refused" in health.json()["problems"]
    settings = make_settings(engines=_engines(standin), redis_url=dead, limiter_fail_open=True)
    async with running_gateway(settings) as gw:
        _, limited = await gw.create_tenant("limited2", requests_per_minute=100)
        ok = await gw.client.post("/v1/completions", json=BODY, headers=bearer(limited))
        assert ok.status_code == 200


async def test_in_process_limiter_without_redis(gateway) -> None:
    assert gateway.state.limiter.backend == "memory"
    _, key = await gateway.create_tenant("acme", requests_per_minute=2)
    statuses = [
        (await gateway.client.post("/v1/completions", json=BODY, headers=bearer(key))).status_code
        for _ in range(3)
    ]
    assert statuses == [200, 200, 429]


async def test_upstream_failures_release_the_slot(make_settings, standin, redis_url) -> None:
    async with _apps(make_settings, standin, 1, redis_url=redis_url) as (gw,):
        tenant_id, key = await gw.create_tenant("acme", max_concurrency=1)
        standin.controls.completion_status = 500  # admitted, then the engine fails
        for stream in (False, True, False):
            response = await gw.client.post(
                "/v1/completions", json={**BODY, "stream": stream}, headers=bearer(key)
            )
            assert (response.status_code, response.json()["error"]["code"]) == (
                502,
                "upstream_error",
            )
        standin.controls.completion_status = 200
        standin.controls.break_after_words = 2  # the engine drops mid-stream
        response = await gw.client.post(
            "/v1/completions", json={**BODY, "stream": True}, headers=bearer(key)
        )
        assert response.status_code == 200
        assert response.text.rstrip().endswith('"code":"upstream_error"}}')
        await standin.stop()  # the engine is gone: even the token count fails
        response = await gw.client.post("/v1/completions", json=BODY, headers=bearer(key))
        assert (response.status_code, response.json()["error"]["code"]) == (
            502,
            "token_count_unavailable",
        )
    assert redis.Redis.from_url(redis_url).zcard(f"kvg:lim:{{{tenant_id}}}:leases") == 0


async def test_client_disconnect_mid_stream_releases_everything(
    make_settings, standin, redis_url
) -> None:
    standin.controls.chunk_delay_s = 0.05
    settings = make_settings(engines=_engines(standin), redis_url=redis_url)
    app = create_app(settings)
    server = await serve(app, lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            admin = {"Authorization": f"Bearer {settings.admin_secret()}"}
            created = await client.post(
                "/admin/tenants", json={"name": "acme", "max_concurrency": 1}, headers=admin
            )
            tenant_id, key = created.json()["tenant"]["id"], created.json()["key"]["key"]
            body = {**BODY, "prompt": " ".join(["word"] * 200), "max_tokens": 200, "stream": True}
            async with client.stream(
                "POST", "/v1/completions", json=body, headers=bearer(key)
            ) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    break  # the client goes away after the first chunk
            leases = redis.Redis.from_url(redis_url)
            for _ in range(200):
                if leases.zcard(f"kvg:lim:{{{tenant_id}}}:leases") == 0:
                    break
                await asyncio.sleep(0.02)
            assert leases.zcard(f"kvg:lim:{{{tenant_id}}}:leases") == 0
            for _ in range(100):
                if standin.controls.active_streams == 0:
                    break
                await asyncio.sleep(0.02)
            assert standin.controls.active_streams == 0  # the engine saw the client go too
            again = await client.post("/v1/completions", json=BODY, headers=bearer(key))
            assert again.status_code == 200
            state = app.state.gateway
            await state.audit.flush()
            usage = await client.get("/v1/usage", headers=bearer(key))
            outcomes = {row["outcome"]: row["requests"] for row in usage.json()["by_outcome"]}
            assert outcomes == {"cancelled": 1, "completed": 1}
    finally:
        await server.stop()
