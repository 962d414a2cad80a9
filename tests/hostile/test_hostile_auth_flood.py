"""Floods of API keys against the database (issue 32, finding 3).

Attacker: a client that opens many connections with well-formed unknown keys (each used to cost a
database lookup, failures neither remembered nor throttled: a legitimate tenant went from 12 ms to
a 3.7 s median), and a tenant whose own burst of 1,000 connections took the database pool
(591 x 503 ``database_unavailable``). And the operator's promise: a key created on one replica
works at once on every replica, whatever was refused there before.

Proves, against the real gateway under uvicorn on 127.0.0.1 with PostgreSQL, counting the
gateway's own key lookups (statements on ``api_keys``): the same unknown key costs one lookup
however often it comes; distinct unknown keys from one address cost at most the address's
failure budget, then 429 before any lookup; a tenant's burst of concurrent requests with a cold
cache costs one lookup, and neither that tenant nor another sees a 503; a key created through one
replica works at once through another that had refused a token with the same prefix, and its
revocation reaches the other within ``auth_cache_ttl_s``. The latency under a 1,000-connection
flood is measured by ``bench/bench_auth_flood.py``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from hostile_harness import ServedGateway, gateway_settings, openai_error, served_gateway
from sqlalchemy import event

BUDGET = 10


def unknown_key() -> str:
    return f"kvg_{secrets.token_hex(6)}_{secrets.token_hex(32)}"


class KeyReads:
    """The gateway's reads of ``api_keys`` meanwhile: ``lookups`` -- one key by its prefix, on the
    gateway's own lookup connections (``gateway.services.keys.LookupLinks``), as many as its auth
    cache started (``AuthCache.lookups``) -- and ``prefixes`` -- the keys stored since the last
    such read (statements on its engine)."""

    def __init__(self, gw: ServedGateway) -> None:
        self._cache = gw.app.state.gateway.auth_cache
        self._before = self._cache.lookups
        self._after: int | None = None
        self.prefixes: list[str] = []

    @property
    def lookups(self) -> int:
        now = self._cache.lookups if self._after is None else self._after
        return now - self._before

    def end(self) -> None:
        self._after = self._cache.lookups


@contextmanager
def key_reads(gw: ServedGateway) -> Iterator[KeyReads]:
    reads = KeyReads(gw)
    db = gw.app.state.gateway.db

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        assert "api_keys.prefix =" not in statement, "a key lookup off the lookup connections"
        if "FROM api_keys" in statement:
            reads.prefixes.append(statement)

    event.listen(db, "before_cursor_execute", count)
    try:
        yield reads
    finally:
        event.remove(db, "before_cursor_execute", count)
        reads.end()


@pytest.fixture
def pg_gateway(
    postgres_url: str, engine: Any, request: pytest.FixtureRequest
) -> Iterator[ServedGateway]:
    overrides = {"auth_cache_ttl_s": 0.5, **getattr(request, "param", {})}
    settings = gateway_settings(
        postgres_url, engine.url, auth_failures_per_minute=BUDGET, **overrides
    )
    with served_gateway(settings) as gw:
        yield gw


def _models(client: httpx.Client, key: str) -> httpx.Response:
    return client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})


def test_unknown_keys_cost_no_lookup_of_their_own(pg_gateway: ServedGateway) -> None:
    """An unknown key -- the same one again and again, or a new one every time from many
    addresses -- is answered from the replica's set of existing prefixes: no lookup of the key,
    and at most one small read of new prefixes per 50 ms however many arrive."""
    gw = pg_gateway
    key = unknown_key()
    with httpx.Client(base_url=gw.url, timeout=10) as client, key_reads(gw) as reads:
        codes = [_models(client, key).status_code for _ in range(BUDGET)]
        assert codes == [401] * BUDGET
        assert (reads.lookups, len(reads.prefixes)) == (0, 1)
    with key_reads(gw) as reads:
        started = time.monotonic()
        statuses: list[int] = []
        for n in range(4):  # 4 addresses, each within its budget: every key reaches the gateway
            transport = httpx.HTTPTransport(local_address=f"127.0.0.{10 + n}")
            with httpx.Client(base_url=gw.url, transport=transport, timeout=10) as other:
                statuses += [_models(other, unknown_key()).status_code for _ in range(BUDGET)]
        elapsed = time.monotonic() - started
        assert set(statuses) == {401}
        assert reads.lookups == 0
        assert len(reads.prefixes) <= 1 + elapsed / 0.05  # PREFIX_REFRESH_S


def test_an_address_that_keeps_failing_is_refused_before_any_lookup(
    pg_gateway: ServedGateway,
) -> None:
    """Guessed secrets under a real prefix (prefixes are not secret) do reach a lookup each: one
    address gets its failure budget of them, then 429 before any lookup, while a tenant on
    another address is served."""
    gw = pg_gateway
    _, key = gw.create_tenant("bystander")
    scheme, prefix, _ = key.split("_")
    transport = httpx.HTTPTransport(local_address="127.0.0.3")
    with (
        httpx.Client(base_url=gw.url, transport=transport, timeout=10) as guesser,
        key_reads(gw) as reads,
    ):
        responses = [
            _models(guesser, f"{scheme}_{prefix}_{secrets.token_hex(32)}")
            for _ in range(5 * BUDGET)
        ]
        codes = [r.status_code for r in responses]
        assert codes[:BUDGET] == [401] * BUDGET and set(codes[BUDGET:]) == {429}, codes
        assert openai_error(responses[-1])["code"] == "too_many_failed_credentials"
        assert reads.lookups == BUDGET  # nothing after the budget reached the database
    with httpx.Client(base_url=gw.url, timeout=10) as bystander:
        assert _models(bystander, key).status_code == 200


async def _burst(url: str, keys: list[str], per_key: int) -> dict[str, list[int]]:
    limits = httpx.Limits(max_connections=len(keys) * per_key)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one(key: str) -> int:
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            return r.status_code

        tasks = {key: [one(key) for _ in range(per_key)] for key in keys}
        results = {key: await asyncio.gather(*calls) for key, calls in tasks.items()}
    return {key: list(codes) for key, codes in results.items()}


# The burst's 300 clients share this process (and its GIL) with the served gateway: on a starved
# machine some wrote their request heads after the harness's short head timeout (a 408 before any
# key lookup, which this test is not about). Slow heads have tests of their own (test_hostile_edge).
BURST = {"auth_cache_ttl_s": 60.0, "header_timeout_s": 30.0}


@pytest.mark.parametrize("pg_gateway", [BURST], indirect=True)
def test_a_tenants_burst_costs_one_lookup_and_nobody_a_503(pg_gateway: ServedGateway) -> None:
    gw = pg_gateway
    _, bursting = gw.create_tenant("bursting")
    _, quiet = gw.create_tenant("quiet")
    with key_reads(gw) as reads:
        codes = asyncio.run(_burst(gw.url, [bursting, quiet], per_key=150))
    assert set(codes[bursting]) == {200} and set(codes[quiet]) == {200}, codes
    # One lookup per key: every other request of the burst waited for it (or found it cached).
    assert reads.lookups == 2


def test_a_new_key_works_at_once_on_every_replica(postgres_url: str, engine: Any) -> None:
    settings = gateway_settings(postgres_url, engine.url, auth_cache_ttl_s=0.5)
    with served_gateway(settings) as a, served_gateway(settings) as b:
        tenant, _ = a.create_tenant("acme")
        issued = httpx.post(f"{a.url}/admin/tenants/{tenant}/keys", json={}, headers=a.admin)
        key = issued.json()["key"]
        scheme, prefix, _ = key.split("_")
        with httpx.Client(base_url=b.url, timeout=10) as client:
            # B refuses (and remembers refusing) a token with the new key's prefix ...
            assert _models(client, f"{scheme}_{prefix}_{'0' * 64}").status_code == 401
            # ... and still takes the key itself at once: a refusal is per whole token.
            assert _models(client, key).status_code == 200
            revoked = httpx.post(f"{a.url}/admin/keys/{prefix}/revoke", headers=a.admin)
            assert revoked.status_code == 200
            deadline = time.monotonic() + 10 * settings.auth_cache_ttl_s
            while _models(client, key).status_code == 200:  # B's entry lives ttl at most
                assert time.monotonic() < deadline, "revocation never reached the other replica"
                time.sleep(0.05)
            assert _models(client, key).status_code == 401
