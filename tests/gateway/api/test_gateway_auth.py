"""Auth on /v1/*: valid, revoked, expired, malformed, another tenant's prefix -> exact statuses
and OpenAI-style bodies."""

from __future__ import annotations

from datetime import timedelta

from gateway_harness import bearer

from contracts.sql import utcnow

ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/usage", None),
    ("POST", "/v1/completions", {"model": "standin-model", "prompt": "hi", "max_tokens": 1}),
    (
        "POST",
        "/v1/chat/completions",
        {
            "model": "standin-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        },
    ),
]


async def _call(gateway, method: str, path: str, body, headers):
    return await gateway.client.request(method, path, json=body, headers=headers)


def _assert_401(response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["type"]) == ("invalid_api_key", "authentication_error")
    assert response.headers["www-authenticate"] == "Bearer"


async def test_valid_key_reaches_every_route(gateway) -> None:
    _, key = await gateway.create_tenant("acme")
    for method, path, body in ROUTES:
        response = await _call(gateway, method, path, body, bearer(key))
        assert response.status_code == 200, (path, response.text)


async def test_missing_and_malformed_credentials(gateway) -> None:
    _, key = await gateway.create_tenant("acme")
    variants = [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {key}"},
        bearer("sk-not-ours"),
        bearer(key[:-1]),
        bearer(key + "0"),
        bearer(key.upper()),
    ]
    for method, path, body in ROUTES:
        for headers in variants:
            _assert_401(await _call(gateway, method, path, body, headers))


async def test_other_tenants_prefix_with_wrong_secret(gateway) -> None:
    _, key_a = await gateway.create_tenant("a")
    _, key_b = await gateway.create_tenant("b")
    prefix_a = key_a.split("_")[1]
    secret_b = key_b.split("_")[2]
    for method, path, body in ROUTES:
        _assert_401(await _call(gateway, method, path, body, bearer(f"kvg_{prefix_a}_{secret_b}")))


async def test_revoked_and_expired_keys(gateway) -> None:
    tenant_id, key = await gateway.create_tenant("acme")
    short = await gateway.client.post(
        f"/admin/tenants/{tenant_id}/keys", json={"expires_in_s": 1}, headers=gateway.admin
    )
    short_key = short.json()["key"]
    assert (await gateway.client.get("/v1/models", headers=bearer(short_key))).status_code == 200
    await gateway.client.post(f"/admin/keys/{key.split('_')[1]}/revoke", headers=gateway.admin)
    later = utcnow() + timedelta(seconds=1.1)
    gateway.state.clock = lambda: later  # the one-second key has expired
    for method, path, body in ROUTES:
        revoked = await _call(gateway, method, path, body, bearer(key))
        _assert_401(revoked)
        assert revoked.json()["error"]["message"] == "This API key has been revoked."
        expired = await _call(gateway, method, path, body, bearer(short_key))
        _assert_401(expired)
        assert expired.json()["error"]["message"] == "This API key has expired."


async def test_last_used_is_recorded(gateway) -> None:
    tenant_id, key = await gateway.create_tenant("acme")
    keys = await gateway.client.get(f"/admin/tenants/{tenant_id}/keys", headers=gateway.admin)
    assert keys.json()[0]["last_used_at"] is None
    await gateway.client.get("/v1/models", headers=bearer(key))
    await gateway.state.audit.flush()
    keys = await gateway.client.get(f"/admin/tenants/{tenant_id}/keys", headers=gateway.admin)
    assert keys.json()[0]["last_used_at"] is not None
