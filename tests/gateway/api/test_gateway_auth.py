"""Auth on /v1/*: valid, revoked, expired, malformed, another tenant's prefix -> exact statuses
and OpenAI-style bodies."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from gateway_harness import bearer, running_gateway

from contracts.sql import session_scope, utcnow
from gateway.services.keys import revoke_key

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


@pytest.mark.parametrize("database", ["sqlite_url", "postgres_url"])
async def test_a_key_in_use_is_renewed_off_the_request_path_and_a_revocation_elsewhere_applies_within_the_ttl(  # noqa: E501
    make_settings, standin, request, database
) -> None:
    """A key used across many ttls is verified again in the background (``renew_verified_keys``:
    on PostgreSQL over the loop's own connection, ``gateway.db.link``): after its first lookup,
    no request waits for the database. A revocation written by another replica (straight to the
    database: this replica's cache is not cleared) refuses the key within the ttl: no request
    sent later than the revocation plus the ttl is answered 200."""
    ttl = 1.0
    settings = make_settings(
        engines=[{"name": "standin", "kind": "bundled", "base_url": standin.url}],
        auth_cache_ttl_s=ttl,
        database_url=request.getfixturevalue(database),
    )
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        cache = gw.state.auth_cache
        assert (await gw.client.get("/v1/models", headers=bearer(key))).status_code == 200
        lookups = cache.lookups
        until = utcnow() + timedelta(seconds=ttl * 4)
        while utcnow() < until:  # four ttls of use
            assert (await gw.client.get("/v1/models", headers=bearer(key))).status_code == 200
            await asyncio.sleep(0.02)
        assert cache.lookups == lookups  # renewed in the background, never on a request

        with session_scope(gw.state.sessions) as session:
            revoke_key(session, prefix=key.split("_")[1], now=utcnow())
        revoked = utcnow()  # committed: every read that starts from now on sees it
        late_200s = []
        for _ in range(500):
            sent = utcnow()
            status = (await gw.client.get("/v1/models", headers=bearer(key))).status_code
            if status == 401:
                break
            assert status == 200
            if sent > revoked + timedelta(seconds=ttl):
                late_200s.append(sent - revoked)
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the revoked key was never refused")
        assert late_200s == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_an_unauthenticated_body_is_never_parsed(gateway, monkeypatch, path) -> None:
    """The key is checked before the body is read as JSON: a client with no valid key costs a
    cached key lookup, not the parse of up to 8 MiB (0.2-0.9 s of the event loop, most of it
    the garbage collector's, for a body of millions of small containers). So a bad key with a
    bad body is a 401, not a 400."""
    import gateway.proxy.door as door

    parsed: list[bytes] = []
    parse = door._json

    def counted(raw: bytes, content_type: str | None):
        parsed.append(raw)
        return parse(raw, content_type)

    monkeypatch.setattr(door, "_json", counted)
    _, key = await gateway.create_tenant("acme")
    headers = {"content-type": "application/json"}
    for body in (b"{not json", b"[" + b"[]," * 1000 + b"[]]", b'{"model": 5}'):
        for credentials in ({}, bearer("sk-not-ours"), bearer(key + "0")):
            r = await gateway.client.post(path, content=body, headers={**headers, **credentials})
            _assert_401(r)
    assert parsed == []
    r = await gateway.client.post(path, content=b"{not json", headers={**headers, **bearer(key)})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")
    assert parsed == [b"{not json"]
