"""The gateway on PostgreSQL (production's database): migrations at start, tenants, keys,
requests, audit and usage."""

from __future__ import annotations

from typing import Any

import psycopg
from gateway_harness import bearer, running_gateway
from sqlalchemy import event
from sqlalchemy.engine import make_url

from bench.fault_stack import TcpLink


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


async def test_a_connection_closed_under_a_read_of_the_keys_is_a_503(
    make_settings, standin, postgres_url
) -> None:
    """The driver reports the connection closed under a read of ``api_keys`` on the session pool
    (the new key's prefix; psycopg's InterfaceError, as a call meets a connection the database or
    the watchdog closed while PostgreSQL goes away):
    the data plane's door, the Responses route and FastAPI's routes answer the outage's 503
    ``database_unavailable``, as for a refused connection -- never a 500. The fault is the
    driver's own exception, raised on the real PostgreSQL connection before the statement."""
    settings = make_settings(
        database_url=postgres_url, engines=[{"name": "s", "base_url": standin.url}]
    )
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        engine = gw.state.sessions.kw["bind"]

        def closed(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
            if "api_keys" in statement:
                raise psycopg.InterfaceError("the cursor is closed")

        event.listen(engine, "before_cursor_execute", closed)
        try:
            await _three_routes_answer_the_outage(gw, key)
        finally:
            event.remove(engine, "before_cursor_execute", closed)
        # the database back: the same key works
        assert (await gw.client.get("/v1/models", headers=bearer(key))).status_code == 200


async def test_a_key_lookup_whose_connection_is_reset_is_a_503(
    make_settings, standin, postgres_url
) -> None:
    """A key lookup runs on the gateway's own PostgreSQL connection (``LookupLinks``, not the
    session pool); when the database resets it (every connection reset, new ones refused), the
    driver's own error reaches the data plane's door, the Responses route and FastAPI's routes,
    which answer the outage's 503 ``database_unavailable`` -- never a 500 -- and once the
    database is reachable the same key works on a new connection. No key is cached (a ttl of 0),
    so every request asks the database."""
    url = make_url(postgres_url)
    assert url.host is not None and url.port is not None
    tcp = TcpLink(url.host, url.port)
    settings = make_settings(
        database_url=url.set(port=tcp.port).render_as_string(hide_password=False),
        engines=[{"name": "s", "base_url": standin.url}],
        auth_cache_ttl_s=0,
    )
    try:
        async with running_gateway(settings) as gw:
            _, key = await gw.create_tenant("acme")
            assert (await gw.client.get("/v1/models", headers=bearer(key))).status_code == 200
            lookups = gw.state.auth_cache.lookups
            tcp.cut()
            await _three_routes_answer_the_outage(gw, key)
            assert gw.state.auth_cache.lookups == lookups + 3  # each one asked, on the link
            tcp.restore()
            assert (await gw.client.get("/v1/models", headers=bearer(key))).status_code == 200
    finally:
        tcp.close()


async def _three_routes_answer_the_outage(gw: Any, key: str) -> None:
    """The data plane's door, the Responses route and a FastAPI route each answer the outage's
    503 ``database_unavailable``."""
    body = {"model": "standin-model", "prompt": "one two three", "max_tokens": 3}
    answers = [
        await gw.client.post("/v1/completions", json=body, headers=bearer(key)),
        await gw.client.post(
            "/v1/responses", json={"model": "standin-model", "input": "hi"}, headers=bearer(key)
        ),
        await gw.client.get("/v1/models", headers=bearer(key)),
    ]
    for r in answers:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "database_unavailable", r.text


async def test_a_bug_under_the_door_is_a_json_500(make_settings, standin, postgres_url) -> None:
    """Anything else raised while the door reads the key (here a RuntimeError before the lookup's
    statement) is the gateway's JSON 500 ``internal_error``, as on FastAPI's routes: never the
    server's bare 'Internal Server Error' without a code."""
    settings = make_settings(
        database_url=postgres_url, engines=[{"name": "s", "base_url": standin.url}]
    )
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        engine = gw.state.sessions.kw["bind"]

        def broken(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
            if "api_keys" in statement:
                raise RuntimeError("a defect")

        event.listen(engine, "before_cursor_execute", broken)
        try:
            body = {"model": "standin-model", "prompt": "one two three", "max_tokens": 3}
            r = await gw.client.post("/v1/completions", json=body, headers=bearer(key))
        finally:
            event.remove(engine, "before_cursor_execute", broken)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "internal_error", r.text
