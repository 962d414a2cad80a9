"""Admin API: separate credential, tenants, keys shown once, limits, usage isolation."""

from __future__ import annotations

from gateway_harness import bearer


async def test_admin_api_needs_the_admin_token(gateway) -> None:
    _, key = await gateway.create_tenant("acme")
    for headers in ({}, bearer("wrong"), bearer(key), {"Authorization": "Basic abc"}):
        response = await gateway.client.get("/admin/tenants", headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert (
        "Tenant API keys"
        in (await gateway.client.get("/admin/tenants", headers=bearer(key))).json()["error"][
            "message"
        ]
    )


async def test_tenant_lifecycle_and_keys_shown_once(gateway) -> None:
    tenant_id, first_key = await gateway.create_tenant("acme", requests_per_minute=10)
    listed = await gateway.client.get("/admin/tenants", headers=gateway.admin)
    assert [t["name"] for t in listed.json()] == ["acme"]
    assert first_key not in listed.text

    issued = await gateway.client.post(
        f"/admin/tenants/{tenant_id}/keys",
        json={"name": "ci", "expires_in_s": 3600},
        headers=gateway.admin,
    )
    assert issued.status_code == 201
    second = issued.json()
    keys = await gateway.client.get("/admin/tenants/acme/keys", headers=gateway.admin)
    assert [k["name"] for k in keys.json()] == [None, "ci"]
    assert second["key"] not in keys.text and first_key not in keys.text
    assert keys.json()[1]["expires_at"] is not None

    patched = await gateway.client.patch(
        "/admin/tenants/acme",
        json={"requests_per_minute": None, "tokens_per_minute": 500, "status": "disabled"},
        headers=gateway.admin,
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert (body["requests_per_minute"], body["tokens_per_minute"], body["status"]) == (
        None,
        500,
        "disabled",
    )
    refused = await gateway.client.get("/v1/models", headers=bearer(first_key))
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "tenant_disabled")


async def test_revoke_then_key_fails(gateway) -> None:
    _, key = await gateway.create_tenant("acme")
    assert (await gateway.client.get("/v1/models", headers=bearer(key))).status_code == 200
    prefix = key.split("_")[1]
    revoked = await gateway.client.post(f"/admin/keys/{prefix}/revoke", headers=gateway.admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    after = await gateway.client.get("/v1/models", headers=bearer(key))
    assert after.status_code == 401
    assert after.json()["error"]["message"] == "This API key has been revoked."


async def test_admin_errors_are_openai_style(gateway) -> None:
    await gateway.create_tenant("acme")
    dup = await gateway.client.post("/admin/tenants", json={"name": "acme"}, headers=gateway.admin)
    assert (dup.status_code, dup.json()["error"]["code"]) == (409, "tenant_exists")
    missing = await gateway.client.get("/admin/tenants/nobody", headers=gateway.admin)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "tenant_not_found")
    bad = await gateway.client.post(
        "/admin/tenants", json={"name": "x", "requests_per_minute": -1}, headers=gateway.admin
    )
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "requests_per_minute")
    extra = await gateway.client.post(
        "/admin/tenants", json={"name": "x", "rpm": 5}, headers=gateway.admin
    )
    assert (extra.status_code, extra.json()["error"]["message"]) == (400, "unknown field 'rpm'")


async def test_tenant_sees_only_its_own_usage(gateway) -> None:
    id_a, key_a = await gateway.create_tenant("a")
    id_b, key_b = await gateway.create_tenant("b")
    body = {"model": "standin-model", "prompt": "one two three", "max_tokens": 2}
    for _ in range(2):
        ok = await gateway.client.post("/v1/completions", json=body, headers=bearer(key_a))
        assert ok.status_code == 200, ok.text
    await gateway.client.post("/v1/completions", json=body, headers=bearer(key_b))
    await gateway.state.audit.flush()

    own = (await gateway.client.get("/v1/usage", headers=bearer(key_a))).json()
    assert (own["tenant_id"], own["requests"], own["prompt_tokens"], own["completion_tokens"]) == (
        id_a,
        2,
        6,
        4,
    )
    wider = await gateway.client.get(f"/v1/usage?tenant_id={id_b}", headers=bearer(key_a))
    assert wider.json()["tenant_id"] == id_a  # no parameter can widen a tenant's view
    admin = await gateway.client.get(f"/admin/tenants/{id_b}/usage", headers=gateway.admin)
    assert (admin.json()["tenant_id"], admin.json()["requests"]) == (id_b, 1)
