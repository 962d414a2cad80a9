"""API keys: format, hash-only storage, authentication outcomes (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime, timedelta

import pytest
from sqlalchemy import event, text

from contracts.sql import make_session_factory, session_scope, utcnow
from gateway.db.link import Link
from gateway.db.session import make_engine, upgrade_database
from gateway.domain import Principal, TenantPlan
from gateway.lifecycle import TenantStatus
from gateway.services.keys import (
    AuthFailure,
    LookupLinks,
    authenticate,
    authenticate_over,
    hash_secret,
    issue_key,
    parse_key,
    renew,
    renew_over,
    revoke_key,
    touch_keys,
    touch_keys_on,
)
from gateway.services.tenants import create_tenant, get_tenant, set_status


@pytest.fixture(params=["sqlite_url", "postgres_url"])
def sessions(request: pytest.FixtureRequest):
    engine = make_engine(request.getfixturevalue(request.param))
    upgrade_database(engine)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
async def linked(postgres_url: str):
    """Sessions and a ``Link`` on one brand-new PostgreSQL database."""
    engine = make_engine(postgres_url)
    upgrade_database(engine)
    link = Link.of(engine, timeout_s=5.0)
    assert link is not None
    try:
        yield make_session_factory(engine), link
    finally:
        await link.close()
        engine.dispose()


def _tenant(sessions, name: str, **plan: int):
    with session_scope(sessions) as session:
        created = create_tenant(session, name=name, plan=TenantPlan(**plan))
        return created.tenant.id, created.first_key


def test_key_format_round_trip() -> None:
    parsed = parse_key("kvg_0123456789ab_" + "f" * 64)
    assert parsed is not None
    assert (parsed.prefix, parsed.secret) == ("0123456789ab", "f" * 64)
    assert "f" * 64 not in repr(parsed)


@pytest.mark.parametrize(
    "token",
    [
        "",
        "kvg_",
        "kvg_0123456789ab",
        "kvg_0123456789ab_" + "f" * 63,
        "kvg_0123456789ab_" + "f" * 65,
        "kvg_0123456789AB_" + "f" * 64,
        "sk_0123456789ab_" + "f" * 64,
        "kvg_0123456789ab_" + "g" * 64,
        "kvg_0123456789ab_" + "f" * 64 + "\n",
    ],
)
def test_malformed_keys_do_not_parse(token: str) -> None:
    assert parse_key(token) is None


def test_only_prefix_and_hash_are_stored(sessions) -> None:
    tenant_id, key = _tenant(sessions, "acme")
    parsed = parse_key(key.key)
    assert parsed is not None and parsed.prefix == key.prefix
    with session_scope(sessions) as session:
        rows = session.execute(text("SELECT prefix, secret_hash FROM api_keys")).all()
    assert [tuple(row) for row in rows] == [(parsed.prefix, hash_secret(parsed.secret))]
    assert all(parsed.secret not in str(value) for row in rows for value in row)
    assert key.key not in repr(key)


def test_authenticate_valid_key_gives_its_tenant_and_plan(sessions) -> None:
    tenant_id, key = _tenant(sessions, "acme", requests_per_minute=5, max_context_tokens=100)
    with session_scope(sessions) as session:
        principal = authenticate(session, token=key.key, now=utcnow())
    assert not isinstance(principal, AuthFailure)
    assert (principal.tenant_id, principal.key_prefix) == (tenant_id, key.prefix)
    assert principal.plan == TenantPlan(requests_per_minute=5, max_context_tokens=100)


def test_wrong_secret_and_other_tenants_prefix_are_refused_alike(sessions) -> None:
    _, key_a = _tenant(sessions, "a")
    _, key_b = _tenant(sessions, "b")
    secret_b = parse_key(key_b.key).secret
    forged = f"kvg_{key_a.prefix}_{secret_b}"  # A's prefix with B's (valid) secret
    unknown = "kvg_000000000000_" + "0" * 64
    with session_scope(sessions) as session:
        results = [authenticate(session, token=t, now=utcnow()) for t in (forged, unknown)]
    assert results == [AuthFailure.UNKNOWN, AuthFailure.UNKNOWN]


def test_revoked_expired_and_disabled(sessions) -> None:
    tenant_id, key = _tenant(sessions, "acme")
    now = utcnow()
    with session_scope(sessions) as session:
        soon = issue_key(session, tenant_id=tenant_id, expires_at=now + timedelta(seconds=60))
    with session_scope(sessions) as session:
        assert authenticate(session, token=soon.key, now=now) is not None
        assert authenticate(session, token=soon.key, now=now + timedelta(seconds=61)) is (
            AuthFailure.EXPIRED
        )
        revoke_key(session, prefix=key.prefix, now=now)
    with session_scope(sessions) as session:
        assert authenticate(session, token=key.key, now=now) is AuthFailure.REVOKED
        set_status(session, tenant=get_tenant(session, ref="acme"), status=TenantStatus.DISABLED)
    with session_scope(sessions) as session:
        assert authenticate(session, token=soon.key, now=now) is AuthFailure.TENANT_DISABLED
        assert authenticate(session, token="kvg_nope", now=now) is AuthFailure.MALFORMED


def test_auth_cache_bounds() -> None:
    from datetime import UTC, datetime

    from gateway.domain import Principal
    from gateway.services.auth_cache import AuthCache

    now = datetime(2026, 1, 1, tzinfo=UTC)
    principal = Principal(
        tenant_id="tn_1",
        tenant_name="a",
        key_id=1,
        key_prefix="p",
        plan=TenantPlan(),
        synthetic=False,
        canary_sample_rate=0.0,
        key_last_used_at=None,
        key_expires_at=now + timedelta(seconds=0.5),
    )
    cache = AuthCache(ttl_s=1.0)
    cache.put("tok", principal, now=now)
    assert cache.get("tok", now=now + timedelta(seconds=0.4)) is principal
    assert cache.get("tok", now=now + timedelta(seconds=0.5)) is None  # the key's own expiry
    lasting = dataclasses.replace(principal, key_expires_at=None)
    cache.put("tok", lasting, now=now)
    assert cache.get("tok", now=now + timedelta(seconds=0.9)) is lasting
    assert cache.get("tok", now=now + timedelta(seconds=1.0)) is None  # the cache's own TTL
    cache.put("tok", lasting, now=now)
    off = AuthCache(ttl_s=0)
    off.put("tok", principal, now=now)
    assert off.get("tok", now=now) is None
    cache.clear()
    assert cache.get("tok", now=now) is None


def test_renewal_says_what_authenticate_says_by_key_id(sessions) -> None:
    """``renew``: the verdict ``authenticate`` gives each key now, read by id (the secrets were
    checked before); a key the database no longer holds is left out."""
    tenant_id, key = _tenant(sessions, "acme")
    _, other = _tenant(sessions, "globex")
    now = utcnow()
    with session_scope(sessions) as session:
        soon = issue_key(session, tenant_id=tenant_id, expires_at=now + timedelta(seconds=60))
    with session_scope(sessions) as session:
        live = [authenticate(session, token=k.key, now=now) for k in (key, soon, other)]
        assert all(isinstance(p, Principal) for p in live)
        ids = [p.key_id for p in live if isinstance(p, Principal)]
        assert renew(session, key_ids=[*ids, 10**9], now=now) == dict(zip(ids, live, strict=True))
        revoke_key(session, prefix=key.prefix, now=now)
        set_status(session, tenant=get_tenant(session, ref="globex"), status=TenantStatus.DISABLED)
    with session_scope(sessions) as session:
        later = renew(session, key_ids=ids, now=now + timedelta(seconds=61))
    assert later == {
        ids[0]: AuthFailure.REVOKED,
        ids[1]: AuthFailure.EXPIRED,
        ids[2]: AuthFailure.TENANT_DISABLED,
    }


async def test_renewal_over_a_link_says_what_renew_says(linked) -> None:
    """``renew_over`` (the replica's own PostgreSQL connection, no ORM) gives the verdicts
    ``renew`` gives, principal for principal -- live keys, then revoked, expired and disabled ones
    -- with every time in UTC as the session reads it, and leaves out a key the database no
    longer holds."""
    sessions, link = linked
    tenant_id, key = _tenant(sessions, "acme")
    _, other = _tenant(sessions, "globex")
    now = utcnow()
    with session_scope(sessions) as session:
        soon = issue_key(session, tenant_id=tenant_id, expires_at=now + timedelta(seconds=60))
        live = [authenticate(session, token=k.key, now=now) for k in (key, soon, other)]
    ids = [p.key_id for p in live if isinstance(p, Principal)]
    with session_scope(sessions) as session:
        touch_keys(session, last_used={ids[0]: now})  # a last use to read back
    for at in (now, now + timedelta(seconds=61)):  # all live, then one expired
        with session_scope(sessions) as session:
            expected = renew(session, key_ids=[*ids, 10**9], now=at)
        got = await renew_over(link, key_ids=[*ids, 10**9], now=at)
        assert got == expected and len(got) == 3
        principals = [v for v in got.values() if isinstance(v, Principal)]
        times = [t for p in principals for t in (p.key_last_used_at, p.key_expires_at) if t]
        assert times and all(t.utcoffset() == timedelta(0) for t in times)
        first = got[ids[0]]
        assert isinstance(first, Principal) and first.key_last_used_at == now
    with session_scope(sessions) as session:
        revoke_key(session, prefix=key.prefix, now=now)
        set_status(session, tenant=get_tenant(session, ref="globex"), status=TenantStatus.DISABLED)
    with session_scope(sessions) as session:
        expected = renew(session, key_ids=ids, now=now + timedelta(seconds=61))
    assert await renew_over(link, key_ids=ids, now=now + timedelta(seconds=61)) == expected
    assert await renew_over(link, key_ids=ids, now=now + timedelta(seconds=61)) == {
        ids[0]: AuthFailure.REVOKED,
        ids[1]: AuthFailure.EXPIRED,
        ids[2]: AuthFailure.TENANT_DISABLED,
    }


async def test_a_lookup_over_a_link_says_what_authenticate_says(linked) -> None:
    """``authenticate_over`` (the request path's own PostgreSQL connections) gives the verdict
    ``authenticate`` gives for every kind of token: a live key (its tenant, plan and times, in
    UTC), a wrong secret under a real prefix, an unknown prefix, a malformed token, then the same
    keys expired, revoked and of a disabled tenant."""
    sessions, link = linked
    tenant_id, key = _tenant(sessions, "acme", requests_per_minute=5, max_context_tokens=100)
    _, other = _tenant(sessions, "globex")
    now = utcnow()
    with session_scope(sessions) as session:
        soon = issue_key(session, tenant_id=tenant_id, expires_at=now + timedelta(seconds=60))
    scheme, prefix, _ = key.key.split("_")
    tokens = [
        key.key,
        soon.key,
        other.key,
        f"{scheme}_{prefix}_{parse_key(other.key).secret}",  # a real prefix, another's secret
        "kvg_000000000000_" + "0" * 64,
        "kvg_nope",
    ]

    async def both(at: datetime) -> list[object]:
        with session_scope(sessions) as session:
            expected = [authenticate(session, token=t, now=at) for t in tokens]
        got = [await authenticate_over(link, token=t, now=at) for t in tokens]
        assert got == expected
        return got

    live = await both(now)
    assert [type(v) for v in live[:3]] == [Principal] * 3
    assert live[3:] == [AuthFailure.UNKNOWN, AuthFailure.UNKNOWN, AuthFailure.MALFORMED]
    first, second = live[0], live[1]
    assert isinstance(first, Principal) and isinstance(second, Principal)
    assert first.plan == TenantPlan(requests_per_minute=5, max_context_tokens=100)
    assert second.key_expires_at is not None and second.key_expires_at.utcoffset() == timedelta(0)
    assert (await both(now + timedelta(seconds=61)))[1] is AuthFailure.EXPIRED
    with session_scope(sessions) as session:
        revoke_key(session, prefix=key.prefix, now=now)
        set_status(session, tenant=get_tenant(session, ref="globex"), status=TenantStatus.DISABLED)
    assert (await both(now))[:3] == [
        AuthFailure.REVOKED,
        second,
        AuthFailure.TENANT_DISABLED,
    ]


async def test_lookups_of_one_lane_run_side_by_side_on_connections_of_their_own(
    postgres_url: str,
) -> None:
    """``LookupLinks``: a lane's lookups each take an idle connection of that lane, so while a
    statement waits (here: on a lock another session holds on ``api_keys``) the lane's other
    lookups still reach the database, as many at once as the lane has links, and the other lane
    has its own; each lookup then gets its verdict."""
    engine = make_engine(postgres_url)
    upgrade_database(engine)
    sessions = make_session_factory(engine)
    keys = [_tenant(sessions, f"t{i}")[1].key for i in range(4)]
    links = LookupLinks.of(engine, timeout_s=10.0, per_lane=3)
    assert links is not None
    holder = engine.connect()
    try:
        holder.execute(text("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE"))  # until rollback
        now = utcnow()
        lookups = [
            asyncio.ensure_future(links.authenticate(k, now=now, verified_before=True))
            for k in keys[:3]
        ]
        lookups.append(
            asyncio.ensure_future(links.authenticate(keys[3], now=now, verified_before=False))
        )
        with engine.connect() as watcher:
            waiting = 0
            deadline = asyncio.get_running_loop().time() + 10
            while waiting < 4 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)  # the lookups' statements reach the server meanwhile
                waiting = watcher.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND query LIKE '%api_keys.prefix%'"
                    )
                ).scalar_one()
                watcher.rollback()  # the server keeps one snapshot of the activity per transaction
        assert waiting == 4  # three of the known lane and the other lane's one, at once
        assert not any(lookup.done() for lookup in lookups)
        holder.rollback()
        verdicts = await asyncio.wait_for(asyncio.gather(*lookups), 10)
        assert [type(v) for v in verdicts] == [Principal] * 4
    finally:
        holder.close()
        await links.close()
        engine.dispose()


async def test_lookup_links_are_connected_when_opened(postgres_url: str) -> None:
    """``LookupLinks.open`` (the gateway's start) connects every link of both lanes, so a
    request's first lookup waits for no connection to be made."""
    engine = make_engine(postgres_url)
    upgrade_database(engine)
    links = LookupLinks.of(engine, timeout_s=10.0, per_lane=2)
    assert links is not None
    fresh = text(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND query = 'SET TIME ZONE ''UTC'''"
    )
    try:
        with engine.connect() as watcher:
            assert watcher.execute(fresh).scalar_one() == 0
            watcher.rollback()  # the server keeps one snapshot of the activity per transaction
            await links.open()
            assert watcher.execute(fresh).scalar_one() == 4  # each link's last statement so far
    finally:
        await links.close()
        engine.dispose()


async def test_key_stamps_over_a_link_are_those_touch_keys_writes(linked) -> None:
    """``touch_keys_on`` (the audit writer's flush on its own connection) stamps each key's last
    use as ``touch_keys`` does; a key deleted since it was used matches no row, no error."""
    sessions, link = linked
    _, key = _tenant(sessions, "acme")
    with session_scope(sessions) as session:
        principal = authenticate(session, token=key.key, now=utcnow())
    assert isinstance(principal, Principal) and principal.key_last_used_at is None
    at = utcnow()

    async def stamp(conn) -> None:
        await touch_keys_on(conn, last_used={principal.key_id: at, 10**9: at})

    await link.transaction(stamp)
    with session_scope(sessions) as session:
        stamped = authenticate(session, token=key.key, now=utcnow())
    assert isinstance(stamped, Principal) and stamped.key_last_used_at == at


def test_a_link_is_made_for_postgresql_only(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        assert Link.of(engine, timeout_s=5.0) is None
    finally:
        engine.dispose()


def test_key_stamps_are_written_in_one_statement_and_a_deleted_key_is_no_error(sessions) -> None:
    """The audit flush stamps every key used since the last one; a key deleted meanwhile
    (its tenant deleted) matches no row and must not fail the flush (the rows would wait)."""
    tenant_a, key_a = _tenant(sessions, "stamp-a")
    tenant_b, key_b = _tenant(sessions, "stamp-b")
    at = utcnow()
    updates: list[bool] = []

    def seen(conn, cursor, statement: str, params, context, executemany: bool) -> None:
        if statement.lstrip().upper().startswith("UPDATE API_KEYS"):
            updates.append(executemany)

    with session_scope(sessions) as session:
        ids = dict(session.execute(text("SELECT prefix, id FROM api_keys")).all())
        a, b = ids[key_a.prefix], ids[key_b.prefix]
        engine = session.get_bind()
        event.listen(engine, "before_cursor_execute", seen)
        try:
            touch_keys(session, last_used={a: at, b: at + timedelta(seconds=1), 10**6: at})
        finally:
            event.remove(engine, "before_cursor_execute", seen)
    assert updates == [True]  # one statement, executed for the three keys
    with session_scope(sessions) as session:
        stamps = dict(session.execute(text("SELECT id, last_used_at FROM api_keys")).all())
    assert stamps[a] is not None and stamps[b] is not None and stamps[a] != stamps[b]
