"""The gateway on PostgreSQL (production's database): migrations at start, tenants, keys,
requests, audit and usage."""

from __future__ import annotations

from gateway_harness import bearer, running_gateway


async def test_gateway_on_postgres(make_settings, standin, postgres_url, redis_url) -> None:
    settings = make_settings(
        database_url=postgres_url,
        redis_url=redis_url,
        engines=[{"name": "s", "base_url": standin.url}],
    )
    async with running_gateway(settings) as gw:
        tenant_id, key = await gw.create_tenant("acme", requests_per_minute=5)
        body = {"model": "standin-model", "prompt": "one two three", "max_tokens": 3}
        for stream in (False, True):
            r = await gw.client.post(
                "/v1/completions", json={**body, "stream": stream}, headers=bearer(key)
            )
            assert r.status_code == 200
        prefix = key.split("_")[1]
        await gw.client.post(f"/admin/keys/{prefix}/revoke", headers=gw.admin)
        assert (await gw.client.get("/v1/models", headers=bearer(key))).status_code == 401
        await gw.state.audit.flush()
        usage = (await gw.client.get(f"/admin/tenants/{tenant_id}/usage", headers=gw.admin)).json()
        assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"]) == (2, 6, 6)
        keys = (await gw.client.get(f"/admin/tenants/{tenant_id}/keys", headers=gw.admin)).json()
        assert keys[0]["revoked_at"] is not None and keys[0]["last_used_at"] is not None
