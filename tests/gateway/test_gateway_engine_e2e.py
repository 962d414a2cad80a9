"""End to end against the REAL bundled engine (``kvguard backend unified`` processes from the
``engine_factory`` fixture): capacity truth at limit-1 / limit / limit+1 on an engine whose
window is misconfigured larger than its pool, exact token counts, streaming passed through
intact, a client disconnect releasing the tenant's slot and the engine's pages, fault drills
refused unless an admin overrides."""

from __future__ import annotations

import asyncio
import json

import anyio
import httpx
import pytest
import redis
from gateway_harness import bearer, running_gateway
from sqlalchemy import select

from contracts.sql import session_scope
from gateway.app import create_app
from gateway.db.models import RequestAudit
from kvguard.testing import serve

pytestmark = pytest.mark.slow


async def _start(engine_factory, **options) -> str:
    return await anyio.to_thread.run_sync(lambda: engine_factory(**options))


def _events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]


def _sans_ids(event: str) -> object:
    if event == "[DONE]":
        return event
    obj = json.loads(event)
    obj.pop("id", None)
    obj.pop("created", None)
    return obj


async def _prompt_of(client: httpx.AsyncClient, engine: str, model: str, tokens: int) -> str:
    """A prompt the engine's own tokenizer counts as exactly ``tokens``."""
    base = (await client.post(f"{engine}/tokenize", json={"model": model, "prompt": "a"})).json()
    prompt = "a" * (tokens - base["count"] + 1)
    count = (
        await client.post(f"{engine}/tokenize", json={"model": model, "prompt": prompt})
    ).json()["count"]
    assert count == tokens
    return prompt


async def test_capacity_truth_on_a_drifted_engine(engine_factory, make_settings) -> None:
    engine = await _start(
        engine_factory,
        pool_tokens=256,
        page_size=16,
        context_window=1024,
        allow_capacity_drift=True,
    )
    async with running_gateway(make_settings(engines=[{"name": "real", "base_url": engine}])) as gw:
        _, key = await gw.create_tenant("acme")
        models = (await gw.client.get("/v1/models", headers=bearer(key))).json()["data"]
        assert len(models) == 1 and models[0]["max_model_len"] == 256
        model = models[0]["id"]
        async with httpx.AsyncClient(timeout=30) as direct:
            results = {}
            for total in (255, 256, 257, 384):
                prompt = await _prompt_of(direct, engine, model, total - 8)
                r = await gw.client.post(
                    "/v1/completions",
                    headers=bearer(key),
                    json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
                )
                results[total] = (r.status_code, r.json().get("error", {}).get("code"))
                if r.status_code == 200:
                    assert r.json()["usage"]["prompt_tokens"] == total - 8
            direct_refusal = await direct.post(
                f"{engine}/v1/completions",
                json={
                    "model": model,
                    "prompt": await _prompt_of(direct, engine, model, 249),
                    "max_tokens": 8,
                },
            )
        assert results == {
            255: (200, None),
            256: (200, None),
            257: (400, "context_length_exceeded"),
            384: (400, "context_length_exceeded"),
        }
        assert direct_refusal.status_code == 400  # the engine agrees: 257 does not fit
        chat = {
            "model": model,
            "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        r = await gw.client.post("/v1/chat/completions", json=chat, headers=bearer(key))
        assert r.status_code == 200
        engine_prompt_tokens = r.json()["usage"]["prompt_tokens"]

        health = (await gw.client.get("/health")).json()
        assert health["capacity_drift"] == ["real"]
        listed = (await gw.client.get("/admin/engines", headers=gw.admin)).json()[0]
        assert (
            listed["context_window"],
            listed["real_pool_tokens"],
            listed["max_request_tokens"],
        ) == (1024, 256, 256)
        assert "1024" in listed["drift"] and "256" in listed["drift"]
        assert (
            'kvguard_gateway_engine_capacity_drift{engine="real"} 1.0'
            in (await gw.client.get("/metrics")).text
        )

        await gw.state.audit.flush()
        with session_scope(gw.state.sessions) as session:
            rows = list(session.scalars(select(RequestAudit).order_by(RequestAudit.id)))
    assert [(r.http_status, r.engine, r.prompt_tokens) for r in rows] == [
        (200, "real", 247),
        (200, "real", 248),
        (400, None, 249),
        (400, None, 376),
        (200, "real", engine_prompt_tokens),  # the gateway's count is the engine's count
    ]


async def test_stream_intact_and_disconnect_releases(
    engine_factory, make_settings, redis_url
) -> None:
    engine = await _start(engine_factory, pool_tokens=4096, page_size=16, context_window=4096)
    settings = make_settings(engines=[{"name": "real", "base_url": engine}], redis_url=redis_url)
    app = create_app(settings)
    server = await serve(app, lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            created = await client.post(
                "/admin/tenants",
                headers=bearer(settings.admin_secret()),
                json={"name": "acme", "max_concurrency": 1},
            )
            tenant_id, key = created.json()["tenant"]["id"], created.json()["key"]["key"]
            model = (await client.get("/v1/models", headers=bearer(key))).json()["data"][0]["id"]
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": 24,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            via_gateway = await client.post("/v1/chat/completions", json=body, headers=bearer(key))
            direct = await client.post(f"{engine}/v1/chat/completions", json=body)
            assert via_gateway.status_code == direct.status_code == 200
            # the engine's events, its kvguard object (role, proof) replaced by the gateway's in
            # the final chunk (the usage chunk): request id, isolation verdict, redactions
            relayed = [_sans_ids(e) for e in _events(via_gateway.content)]
            engine_events = [_sans_ids(e) for e in _events(direct.content)]
            for event in engine_events:
                if isinstance(event, dict):
                    event.pop("kvguard", None)
            final = relayed[-2]
            assert isinstance(final, dict) and "usage" in final
            assert final.pop("kvguard") == {
                "request_id": via_gateway.headers["x-kvguard-request-id"],
                "isolation": "no_handoff",
                "redactions": 0,
            }
            assert relayed == engine_events

            long = {k: v for k, v in body.items() if k != "stream_options"} | {"max_tokens": 3000}
            async with client.stream(
                "POST", "/v1/chat/completions", json=long, headers=bearer(key)
            ) as response:
                assert response.status_code == 200
                async for _ in response.aiter_raw():
                    break  # the client disconnects mid-stream
            leases = redis.Redis.from_url(redis_url)
            for _ in range(100):
                capacity = (await client.get(f"{engine}/engine/capacity")).json()
                idle = capacity["free_pages"] == capacity["pool_pages"]
                if idle and leases.zcard(f"kvg:lim:{{{tenant_id}}}:leases") == 0:
                    break
                await asyncio.sleep(0.05)
            assert leases.zcard(f"kvg:lim:{{{tenant_id}}}:leases") == 0
            assert capacity["free_pages"] == capacity["pool_pages"]  # the engine freed them too
            plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            again = await client.post("/v1/chat/completions", json=plain, headers=bearer(key))
            assert again.status_code == 200  # the slot came back
            await app.state.gateway.audit.flush()
            with session_scope(app.state.gateway.sessions) as session:
                outcomes = list(
                    session.scalars(select(RequestAudit.outcome).order_by(RequestAudit.id))
                )
            assert outcomes == ["completed", "cancelled", "completed"]
    finally:
        await server.stop()


async def test_fault_drills_are_refused_unless_overridden(engine_factory, make_settings) -> None:
    engine = await _start(
        engine_factory,
        pool_tokens=512,
        allow_fault_drills=True,
        env={"KVGUARD_FAULTS": '["no_zero_on_free"]'},
    )
    async with running_gateway(
        make_settings(engines=[{"name": "drill", "base_url": engine}])
    ) as gw:
        _, key = await gw.create_tenant("acme")
        listed = (await gw.client.get("/admin/engines", headers=gw.admin)).json()[0]
        assert (listed["blocked_reason"], listed["faults"]) == ("fault_drill", ["no_zero_on_free"])
        model = listed["model"]
        body = {"model": model, "prompt": "hello", "max_tokens": 4}
        r = await gw.client.post("/v1/completions", json=body, headers=bearer(key))
        assert (r.status_code, r.json()["error"]["code"]) == (503, "no_healthy_engine")
        await gw.client.put(
            "/admin/engines/drill/override", json={"allow_unsafe": True}, headers=gw.admin
        )
        r = await gw.client.post("/v1/completions", json=body, headers=bearer(key))
        assert r.status_code == 200
        await gw.client.put(
            "/admin/engines/drill/override", json={"allow_unsafe": False}, headers=gw.admin
        )
        await gw.state.poller.poll_once()
        r = await gw.client.post("/v1/completions", json=body, headers=bearer(key))
        assert r.status_code == 503


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Größe? 名前 🙂"}],
    [
        {"role": "system", "content": "line one\nline two"},
        {"role": "user", "content": "first", "name": "ann"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": ""},
    ],
    [{"role": "assistant", "content": "no user turn at all"}],
    [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ],
]


async def test_the_gateway_counts_as_the_engine_tokenizer_does(
    engine_factory, make_settings
) -> None:
    """A byte-tokenizer engine reports a countable tokenizer; the gateway's own count equals the
    engine's /tokenize for every chat shape, and it enforces the limit with it exactly (no
    /tokenize round trip)."""
    from contracts.chat_format import TOKENIZER_ID, count_tokens

    engine = await _start(engine_factory, pool_tokens=256, page_size=16, context_window=256)
    async with httpx.AsyncClient(timeout=30) as direct:
        capacity = (await direct.get(f"{engine}/engine/capacity")).json()
        assert capacity["tokenizer"] == TOKENIZER_ID
        model = capacity["model"]
        for messages in CHATS:
            body = {"model": model, "messages": messages}
            engine_count = (await direct.post(f"{engine}/tokenize", json=body)).json()["count"]
            assert count_tokens(None, messages) == engine_count
        for prompt in ("", "plain", "ünïcödé\n" * 3):
            body = {"model": model, "prompt": prompt}
            engine_count = (await direct.post(f"{engine}/tokenize", json=body)).json()["count"]
            assert count_tokens(prompt, None) == engine_count
    assert count_tokens(None, [{"role": "tool", "content": "x"}]) is None
    assert count_tokens(None, [{"role": "user", "content": [{"type": "text"}]}]) is None
    assert count_tokens(None, [{"role": "user", "content": [{"type": "image_url"}]}]) is None
    assert count_tokens(None, [{"role": "user", "content": "x", "tool_calls": []}]) is None

    async with running_gateway(make_settings(engines=[{"name": "real", "base_url": engine}])) as gw:
        _, key = await gw.create_tenant("acme")
        shell = count_tokens(None, [{"role": "user", "content": ""}])
        assert shell is not None
        codes = {}
        for total in (256, 257):  # prompt + max_tokens 8 against the limit of 256
            chat = {
                "model": model,
                "messages": [{"role": "user", "content": "é" * ((total - 8 - shell) // 2)}],
                "max_tokens": 8,
                "temperature": 0,
            }
            if (total - 8 - shell) % 2:
                chat["messages"][0]["content"] += "a"
            assert count_tokens(None, chat["messages"]) == total - 8
            r = await gw.client.post("/v1/chat/completions", json=chat, headers=bearer(key))
            codes[total] = (r.status_code, r.json().get("error", {}).get("code"))
            if r.status_code == 200:
                assert r.json()["usage"]["prompt_tokens"] == total - 8
        assert codes == {256: (200, None), 257: (400, "context_length_exceeded")}
        metrics = (await gw.client.get("/metrics")).text
    assert 'kvguard_gateway_token_counts_total{method="local"} 2.0' in metrics
    assert 'kvguard_gateway_token_counts_total{method="engine"}' not in metrics
