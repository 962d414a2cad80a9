"""Capacity enforcement and routing through the gateway (component tests; the upstream is the
stand-in engine reporting a CapacityReport). The same boundaries against the real engine are in
the engine-integration tests."""

from __future__ import annotations

from gateway_harness import bearer, running_gateway
from gateway_standin import StandInControls, standin_count, start_standin

MODEL = "standin-model"


def _completion(prompt_tokens: int, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": " ".join(["w"] * prompt_tokens), "max_tokens": max_tokens}


async def test_window_larger_than_pool_is_held_to_the_pool(make_settings, standin) -> None:
    standin.controls.context_window, standin.controls.pool_tokens = 4096, 1024  # misconfigured
    settings = make_settings(engines=[{"name": "drifty", "base_url": standin.url}])
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        models = (await gw.client.get("/v1/models", headers=bearer(key))).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 1024)]
        statuses = []
        for total in (1023, 1024, 1025, 1536):
            r = await gw.client.post(
                "/v1/completions", json=_completion(total - 16, 16), headers=bearer(key)
            )
            statuses.append(r.status_code)
        assert statuses == [200, 200, 400, 400]
        assert len(standin.controls.seen_bodies) == 2  # refused requests never reached it
        refused = await gw.client.post(
            "/v1/completions", json=_completion(1009, 16), headers=bearer(key)
        )
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        assert error["message"] == (
            "This model's maximum context length is 1024 tokens. However, you requested 1025 "
            "tokens (1009 in the prompt, 16 in the completion). Please reduce the length of the "
            "prompt or completion. The completion is the request's max_tokens. The limit is the "
            "engine's real capacity; its advertised window is 4096 tokens. "
            "(context_length_exceeded)"
        )
        health = (await gw.client.get("/health")).json()
        assert (health["status"], health["capacity_drift"]) == ("degraded", ["drifty"])
        engines = (await gw.client.get("/admin/engines", headers=gw.admin)).json()
        assert engines[0]["drift"].startswith("context window 4096 exceeds")
        assert (engines[0]["context_window"], engines[0]["real_pool_tokens"]) == (4096, 1024)
        metrics = (await gw.client.get("/metrics")).text
        assert 'kvguard_gateway_engine_capacity_drift{engine="drifty"} 1.0' in metrics


async def test_plan_cap_and_chat_counts(gateway, standin) -> None:
    _, key = await gateway.create_tenant("small", max_context_tokens=100)
    models = (await gateway.client.get("/v1/models", headers=bearer(key))).json()["data"]
    assert models[0]["max_model_len"] == 100
    messages = [{"role": "user", "content": " ".join(["w"] * 50)}]
    prompt = standin_count(messages=messages)  # 53 with the stand-in's chat template
    ok = {"model": MODEL, "messages": messages, "max_tokens": 100 - prompt}
    over = {**ok, "max_tokens": 101 - prompt}
    assert (
        await gateway.client.post("/v1/chat/completions", json=ok, headers=bearer(key))
    ).status_code == 200
    refused = await gateway.client.post("/v1/chat/completions", json=over, headers=bearer(key))
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 100 tokens.")
    assert message.endswith(
        "The completion is the request's max_tokens. The limit is your plan's context limit. "
        "(context_length_exceeded)"
    )
    assert refused.json()["error"]["param"] == "messages"


async def test_fail_closed_on_unknown_stale_faults_and_quarantine(gateway, standin) -> None:
    _, key = await gateway.create_tenant("acme")
    body = _completion(3, 2)

    async def status() -> tuple[int, str | None]:
        r = await gateway.client.post("/v1/completions", json=body, headers=bearer(key))
        return r.status_code, (r.json().get("error") or {}).get("code")

    assert await status() == (200, None)
    record = gateway.state.registry.get("standin")
    record.observed_at -= 1000  # the last good snapshot is now far too old
    assert await status() == (503, "no_healthy_engine")
    await gateway.state.poller.poll_once()
    assert await status() == (200, None)

    standin.controls.faults = ["legacy_handoff"]
    await gateway.state.poller.poll_once()
    assert await status() == (503, "no_healthy_engine")
    r = await gateway.client.put(
        "/admin/engines/standin/override", json={"allow_unsafe": True}, headers=gateway.admin
    )
    assert r.status_code == 200 and r.json()["blocked_reason"] is None
    assert await status() == (200, None)

    r = await gateway.client.post(
        "/admin/engines/standin/quarantine", json={"reason": "canary"}, headers=gateway.admin
    )
    assert (r.json()["blocked_reason"], r.json()["quarantine_reason"]) == ("quarantined", "canary")
    assert await status() == (503, "no_healthy_engine")
    models = (await gateway.client.get("/v1/models", headers=bearer(key))).json()
    assert models["data"] == []
    await gateway.client.delete("/admin/engines/standin/quarantine", headers=gateway.admin)
    await gateway.client.put(
        "/admin/engines/standin/override", json={"allow_unsafe": False}, headers=gateway.admin
    )
    standin.controls.faults = []
    await gateway.state.poller.poll_once()
    assert await status() == (200, None)
    missing = await gateway.client.post(
        "/v1/completions", json={**body, "model": "nope"}, headers=bearer(key)
    )
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")


async def test_unknown_capacity_at_start_is_refused(make_settings) -> None:
    settings = make_settings(
        engines=[{"name": "ghost", "base_url": "http://127.0.0.1:9", "model": MODEL}]
    )
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        r = await gw.client.post("/v1/completions", json=_completion(3, 2), headers=bearer(key))
        assert (r.status_code, r.json()["error"]["code"]) == (503, "no_healthy_engine")
        health = await gw.client.get("/health")
        assert health.status_code == 503 and "no routable engine" in health.json()["problems"]


async def test_admin_registered_engines_and_routing(make_settings) -> None:
    big = await start_standin(StandInControls(pool_tokens=4096))
    small = await start_standin(StandInControls(pool_tokens=512))
    try:
        async with running_gateway(make_settings()) as gw:
            _, key = await gw.create_tenant("acme")
            for name, engine in (("big", big), ("small", small)):
                r = await gw.client.post(
                    "/admin/engines",
                    json={"name": name, "kind": "bundled", "base_url": engine.url},
                    headers=gw.admin,
                )
                assert r.status_code == 201 and r.json()["routable"] is True
            dup = await gw.client.post(
                "/admin/engines",
                json={"name": "big", "kind": "bundled", "base_url": big.url},
                headers=gw.admin,
            )
            assert dup.status_code == 409
            models = (await gw.client.get("/v1/models", headers=bearer(key))).json()["data"]
            assert models[0]["max_model_len"] == 512  # the smallest real limit across engines
            for _ in range(4):  # fits both: spread over both
                await gw.client.post(
                    "/v1/completions", json=_completion(10, 5), headers=bearer(key)
                )
            assert (len(big.controls.seen_bodies), len(small.controls.seen_bodies)) == (2, 2)
            for _ in range(3):  # fits only the big one
                r = await gw.client.post(
                    "/v1/completions", json=_completion(1000, 5), headers=bearer(key)
                )
                assert r.status_code == 200
            assert (len(big.controls.seen_bodies), len(small.controls.seen_bodies)) == (5, 2)
            r = await gw.client.delete("/admin/engines/big", headers=gw.admin)
            assert r.status_code == 204
            r = await gw.client.post(
                "/v1/completions", json=_completion(1000, 5), headers=bearer(key)
            )
            assert r.status_code == 400
    finally:
        await big.stop()
        await small.stop()


async def test_quarantine_reaches_every_replica(make_settings, standin) -> None:
    settings = make_settings(engines=[{"name": "shared", "base_url": standin.url}])
    async with running_gateway(settings) as first, running_gateway(settings) as second:
        _, key = await first.create_tenant("acme")
        body = _completion(3, 2)
        for gw in (first, second):
            r = await gw.client.post("/v1/completions", json=body, headers=bearer(key))
            assert r.status_code == 200
        await first.state.quarantine("shared", reason="canary: foreign marker")
        await second.state.poller.reload_once()  # the next reload reads controls from SQL
        for gw in (first, second):
            r = await gw.client.post("/v1/completions", json=body, headers=bearer(key))
            assert (r.status_code, r.json()["error"]["code"]) == (503, "no_healthy_engine")
        listed = (await second.client.get("/admin/engines", headers=second.admin)).json()
        assert listed[0]["quarantine_reason"] == "canary: foreign marker"
