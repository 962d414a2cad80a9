"""``gateway.services.auth_cache``: verified and refused tokens, one lookup per flight, lanes.

Pure (the database is a counted coroutine here; ``tests/hostile/test_hostile_auth_flood.py`` runs
the same cache in the real gateway against PostgreSQL)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from contracts.sql import DatabaseTimeout
from gateway.domain import Principal, TenantPlan
from gateway.services.auth_cache import AuthCache, KnownPrefixes
from gateway.services.keys import AuthFailure

NOW = datetime(2026, 12, 1, tzinfo=UTC)
ALICE = Principal(
    tenant_id="t1",
    tenant_name="alice",
    key_id=1,
    key_prefix="p1",
    plan=TenantPlan(),
    synthetic=False,
    canary_sample_rate=0.0,
    key_last_used_at=None,
)


def test_refused_tokens_are_remembered_for_as_long_as_their_reason_lasts() -> None:
    cache = AuthCache(ttl_s=1.0, negative_ttl_s=600.0)
    for n, failure in enumerate(
        (AuthFailure.UNKNOWN, AuthFailure.REVOKED, AuthFailure.EXPIRED, AuthFailure.TENANT_DISABLED)
    ):
        cache.put(f"tok{n}", failure, now=NOW)
        assert cache.get(f"tok{n}", now=NOW + timedelta(seconds=0.5)) is failure
    later = NOW + timedelta(seconds=2)
    # Unknown, revoked, expired: final. A disabled tenant may be enabled again: the short TTL.
    assert [cache.get(f"tok{n}", now=later) for n in range(4)] == [
        AuthFailure.UNKNOWN,
        AuthFailure.REVOKED,
        AuthFailure.EXPIRED,
        None,
    ]
    assert cache.get("tok0", now=NOW + timedelta(seconds=601)) is None
    cache.put("bad", AuthFailure.MALFORMED, now=NOW)  # costs no lookup anyway: not kept
    assert cache.get("bad", now=NOW) is None


def test_a_verified_key_replaces_a_refusal_and_clear_forgets_both() -> None:
    cache = AuthCache(ttl_s=5.0)
    cache.put("tok", AuthFailure.TENANT_DISABLED, now=NOW)
    cache.put("tok", ALICE, now=NOW)
    assert cache.get("tok", now=NOW) is ALICE
    cache.put("other", AuthFailure.UNKNOWN, now=NOW)
    cache.clear()
    assert cache.get("tok", now=NOW) is None and cache.get("other", now=NOW) is None


def test_entries_are_bounded() -> None:
    cache = AuthCache(ttl_s=5.0, max_entries=3)
    for n in range(4):
        cache.put(f"tok{n}", AuthFailure.UNKNOWN, now=NOW)
    assert cache.get("tok3", now=NOW) is AuthFailure.UNKNOWN  # full: started over
    assert cache.get("tok0", now=NOW) is None


async def test_one_lookup_serves_every_request_in_flight_for_a_token() -> None:
    cache = AuthCache(ttl_s=1.0)
    gate = asyncio.Event()
    calls = 0

    async def lookup() -> Principal | AuthFailure:
        nonlocal calls
        calls += 1
        await gate.wait()
        return ALICE

    waiters = [
        asyncio.create_task(cache.verify("tok", now=NOW, lookup=lookup, timeout_s=5))
        for _ in range(1000)
    ]
    await asyncio.sleep(0)
    gate.set()
    assert set(await asyncio.gather(*waiters)) == {ALICE}
    assert calls == 1 == cache.lookups
    assert cache.get("tok", now=NOW) is ALICE


async def test_unknown_tokens_hold_at_most_a_lane_and_never_delay_renewals() -> None:
    """A flood of never-seen tokens waits in its own lane (``lane_lookups`` at a time); a token
    this replica verified before is renewed in the other lane, at once."""
    cache = AuthCache(ttl_s=1.0, lane_lookups=2)
    cache.put("known", ALICE, now=NOW - timedelta(seconds=10))  # expired: a renewal is due
    gate = asyncio.Event()
    in_flight = peak = 0

    async def slow() -> Principal | AuthFailure:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await gate.wait()
        in_flight -= 1
        return AuthFailure.UNKNOWN

    async def fast() -> Principal | AuthFailure:
        return ALICE

    flood = [
        asyncio.create_task(cache.verify(f"unknown{n}", now=NOW, lookup=slow, timeout_s=5))
        for n in range(50)
    ]
    await asyncio.sleep(0.01)
    renewed = await asyncio.wait_for(
        cache.verify("known", now=NOW, lookup=fast, timeout_s=5), timeout=1
    )
    assert renewed is ALICE and peak == 2
    gate.set()
    assert set(await asyncio.gather(*flood)) == {AuthFailure.UNKNOWN}


async def test_waiting_for_a_lane_counts_toward_the_database_bound() -> None:
    cache = AuthCache(ttl_s=1.0, lane_lookups=1)
    never = asyncio.Event()

    async def stuck() -> Principal | AuthFailure:
        await never.wait()
        return ALICE

    blocker = asyncio.create_task(cache.verify("a", now=NOW, lookup=stuck, timeout_s=0.2))
    with pytest.raises(DatabaseTimeout):
        await cache.verify("b", now=NOW, lookup=stuck, timeout_s=0.1)
    with pytest.raises(DatabaseTimeout):
        await blocker
    assert cache.get("a", now=NOW) is None  # a timeout is remembered by nobody


async def test_unknown_prefixes_share_a_read_of_new_keys_at_most_every_interval() -> None:
    """A thousand unknown prefixes at once cost at most two reads (each question waits for a read
    that began after it was asked: the first began with the first question) of the keys stored
    since the last read; a prefix stored meanwhile (a key created on another replica) is found
    by the next read."""
    prefixes = KnownPrefixes(min_interval_s=0.05)
    table = [(1, "aaaaaaaaaaaa")]
    asked: list[int] = []

    async def fetch(after_id: int, limit: int) -> list[tuple[int, str]]:
        asked.append(after_id)
        await asyncio.sleep(0.01)
        return [row for row in table if row[0] > after_id][:limit]

    found = await asyncio.gather(
        *(prefixes.holds(f"{n:012x}", fetch=fetch, timeout_s=5) for n in range(1000))
    )
    assert not any(found) and asked in ([0], [0, 1]) and len(prefixes) == 1
    reads = len(asked)
    assert await prefixes.holds("aaaaaaaaaaaa", fetch=fetch, timeout_s=5)  # held: no read
    table.append((2, "bbbbbbbbbbbb"))  # created on another replica
    assert await prefixes.holds("bbbbbbbbbbbb", fetch=fetch, timeout_s=5)
    assert asked[reads:] == [1]  # only the keys stored since the last read


async def test_a_prefix_read_that_does_not_answer_is_a_database_timeout() -> None:
    prefixes = KnownPrefixes()

    async def stuck(after_id: int, limit: int) -> list[tuple[int, str]]:
        await asyncio.Event().wait()
        return []

    with pytest.raises(DatabaseTimeout):
        await prefixes.holds("cccccccccccc", fetch=stuck, timeout_s=0.1)


async def test_a_large_table_is_read_in_batches_each_keeping_its_gain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.services import auth_cache

    monkeypatch.setattr(auth_cache, "PREFIX_BATCH", 3)
    table = [(n, f"{n:012x}") for n in range(1, 8)]
    asked: list[int] = []

    async def fetch(after_id: int, limit: int) -> list[tuple[int, str]]:
        asked.append(after_id)
        return [row for row in table if row[0] > after_id][:limit]

    prefixes = KnownPrefixes()
    assert await prefixes.holds(f"{7:012x}", fetch=fetch, timeout_s=5)
    assert asked == [0, 3, 6] and len(prefixes) == 7


BOB = replace(ALICE, tenant_id="t2", tenant_name="bob", key_id=2, key_prefix="p2")


async def test_renewal_verifies_the_keys_in_use_in_one_read_and_trusts_them_anew() -> None:
    """``renew``: the keys served in the last two rounds, all in one read; each trusted for a
    ttl from the read's start; a key the database refuses now is refused from then on; a key
    not used in the last two rounds is not read (it expires as before)."""
    cache = AuthCache(ttl_s=1.0)
    assert cache.renewal_interval_s == 0.5
    cache.put("alice", ALICE, now=NOW)
    cache.put("bob", BOB, now=NOW)
    cache.put("carol", replace(BOB, key_id=3), now=NOW)
    assert cache.get("alice", now=NOW) is ALICE and cache.get("bob", now=NOW) is BOB
    reads: list[list[int]] = []

    async def fetch(key_ids: list[int]) -> dict[int, Principal | AuthFailure]:
        reads.append(key_ids)
        return {1: ALICE, 2: AuthFailure.REVOKED}

    later = NOW + timedelta(seconds=0.9)
    assert await cache.renew(fetch, now=later) == [ALICE]
    assert reads == [[1, 2]]  # carol was not used: not read
    # the next round reads alice again (used in the round before); then nothing is in use
    assert await cache.renew(fetch, now=later) == [ALICE] and reads[1:] == [[1]]
    assert await cache.renew(fetch, now=later) == [] and len(reads) == 2
    assert cache.get("alice", now=NOW + timedelta(seconds=1.8)) is ALICE  # trusted from 0.9
    assert cache.get("alice", now=NOW + timedelta(seconds=1.9)) is None
    assert cache.get("bob", now=later) is AuthFailure.REVOKED  # at once, not at NOW + 1
    assert cache.get("carol", now=NOW + timedelta(seconds=1)) is None  # expired as before


async def test_a_key_verified_on_the_request_path_is_renewed_in_the_next_round() -> None:
    """A key looked up for a request is in use as much as one served from the cache: the next
    round reads it again, so a key used about once per ttl is not looked up on every request
    (each use landing just past the last lookup's ttl)."""
    cache = AuthCache(ttl_s=1.0)
    lookups: list[str] = []

    async def lookup() -> Principal:
        lookups.append("alice")
        return ALICE

    verdict = await cache.verify("alice", now=NOW, lookup=lookup, timeout_s=1.0)
    assert verdict is ALICE and lookups == ["alice"]
    reads: list[list[int]] = []

    async def fetch(key_ids: list[int]) -> dict[int, Principal | AuthFailure]:
        reads.append(key_ids)
        return {1: ALICE}

    assert await cache.renew(fetch, now=NOW + timedelta(seconds=0.5)) == [ALICE]
    assert reads == [[1]]
    next_use = NOW + timedelta(seconds=1.05)  # past the lookup's ttl, within the renewal's
    assert await cache.verify("alice", now=next_use, lookup=lookup, timeout_s=1.0) is ALICE
    assert lookups == ["alice"]  # served from the cache, no second lookup


async def test_a_key_used_once_per_ttl_and_a_half_never_waits_for_the_database() -> None:
    """A key used once is renewed in the two rounds after its use, so it is trusted for at
    least 1.5 ttl past it: a tenant sending a request every 1.2 s (ttl 1 s) is served from the
    cache every time, never by a lookup on the request path."""
    cache = AuthCache(ttl_s=1.0)
    lookups: list[str] = []

    async def lookup() -> Principal:
        lookups.append("alice")
        return ALICE

    async def fetch(key_ids: list[int]) -> dict[int, Principal | AuthFailure]:
        return {1: ALICE}

    rounds = [NOW + timedelta(seconds=0.5 * n) for n in range(1, 12)]  # every ttl / 2
    uses = [NOW + timedelta(seconds=1.2 * n) for n in range(5)]  # 0, 1.2, 2.4, 3.6, 4.8
    for at in sorted([*rounds, *uses]):
        if at in uses:
            verdict = await cache.verify("alice", now=at, lookup=lookup, timeout_s=1.0)
            assert verdict is ALICE
        else:
            await cache.renew(fetch, now=at)
    assert lookups == ["alice"]  # the first use only


async def test_a_renewal_begun_before_an_admin_change_writes_nothing() -> None:
    """``clear`` (any admin change on this replica: a revocation applies at once) while a
    renewal's read is in flight: what that read says is older than the change, so it is not
    kept; an entry verified again meanwhile keeps the newer answer."""
    cache = AuthCache(ttl_s=1.0)
    cache.put("alice", ALICE, now=NOW)
    cache.get("alice", now=NOW)
    reading, release = asyncio.Event(), asyncio.Event()

    async def fetch(key_ids: list[int]) -> dict[int, Principal | AuthFailure]:
        reading.set()
        await release.wait()
        return {1: ALICE}

    renewal = asyncio.ensure_future(cache.renew(fetch, now=NOW))
    await reading.wait()  # the read is in flight
    cache.clear()
    release.set()
    assert await renewal == []
    assert cache.get("alice", now=NOW) is None

    cache.put("alice", ALICE, now=NOW)
    cache.get("alice", now=NOW)
    newer = replace(ALICE, plan=TenantPlan(requests_per_minute=7))
    reading.clear()
    release.clear()
    renewal = asyncio.ensure_future(cache.renew(fetch, now=NOW))
    await reading.wait()
    cache.put("alice", newer, now=NOW)  # the request path verified it again meanwhile
    release.set()
    assert await renewal == []
    assert cache.get("alice", now=NOW) is newer
