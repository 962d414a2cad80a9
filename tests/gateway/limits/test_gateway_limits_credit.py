"""The Redis limiter's credit (``gateway.limits.redis_limiter``): a replica admits a busy tenant's
requests from what it took in one call, and the buckets and all credit together never hold more
than the plan; credit comes back, or lapses, and the refunds it owes go back with it. Real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from contracts.resp import RespError
from gateway.domain import TenantPlan
from gateway.limits.base import Lease, LimitKind, Refusal
from gateway.limits.redis_limiter import RedisLimiter

TPM = 600_000  # 10,000 tokens refill per second


@pytest.fixture
def client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def tenant() -> str:
    return uuid.uuid4().hex


def scripts_run(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def redis_now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def held(client: redis.Redis, tenant: str) -> tuple[float, int]:
    """The tokens bucket's stored level and the tokens lent out of it as credit (live or not)."""
    level = client.hget(f"kvg:lim:{{{tenant}}}:tokens", "level")
    lent = client.hvals(f"kvg:lim:{{{tenant}}}:lent")
    return float(level or TPM), sum(int(v.split()[1]) for v in lent)


def assert_held(
    client: redis.Redis, tenant: str, level: int, lent: int | None, since: float
) -> None:
    """The bucket holds ``level`` tokens plus what it refilled since ``since`` (Redis counts
    whole milliseconds: up to 3 ms more), and ``lent`` are lent out (None: whatever)."""
    found, found_lent = held(client, tenant)
    refill = ((time.monotonic() - since) * 1000 + 3) * TPM / 60_000
    assert lent is None or found_lent == lent
    assert level <= found <= level + refill, (found, level)


async def test_a_busy_tenant_is_admitted_from_credit_without_a_call(
    redis_url, client, tenant
) -> None:
    limiter = RedisLimiter(url=redis_url, lease_s=30, credit_s=5)
    plan = TenantPlan(requests_per_minute=6_000, tokens_per_minute=TPM)
    try:
        await limiter.admit(tenant_id="w" + tenant, plan=plan, tokens=1)  # the script is loaded
        before, started = scripts_run(client), time.monotonic()
        leases = [await limiter.admit(tenant_id=tenant, plan=plan, tokens=100) for _ in range(100)]
        elapsed = time.monotonic() - started
        assert all(isinstance(lease, Lease) for lease in leases)
        # the first call takes no credit (the tenant is not busy here yet); the second takes 5 s
        # of refill: 500 requests and 50,000 tokens, for the other 98
        assert scripts_run(client) == before + 2
        assert_held(client, tenant, TPM - 200 - 50_000, 50_000, started)
        # the headers count what this replica holds as the tenant's: as if every take were a call
        remaining = [lease.levels.requests.remaining for lease in leases]  # type: ignore[union-attr]
        assert remaining[0] == 5_999
        refill = int(elapsed * 100) + 1  # 6,000 per minute
        assert 5_900 <= remaining[-1] <= 5_900 + refill
        assert remaining == sorted(remaining, reverse=True)
        # a plan with a concurrency cap holds a lease of its own in Redis for every request
        capped = TenantPlan(tokens_per_minute=TPM, max_concurrency=50)
        before = scripts_run(client)
        for _ in range(3):
            assert isinstance(
                await limiter.admit(tenant_id="c" + tenant, plan=capped, tokens=1), Lease
            )
        assert scripts_run(client) == before + 3
    finally:
        await limiter.close()


async def test_the_buckets_and_the_credit_lent_never_hold_more_than_the_plan(
    redis_url, tenant
) -> None:
    """A bucket refills only up to its capacity less the credit lent out of it: what replica A
    holds cannot also be taken by B, however long A keeps it."""
    a = RedisLimiter(url=redis_url, lease_s=30, credit_s=5)
    b = RedisLimiter(url=redis_url, lease_s=30, credit_s=5)
    plan = TenantPlan(tokens_per_minute=TPM)
    try:
        for _ in range(2):  # the second, for a tenant busy here, takes credit
            assert isinstance(await a.admit(tenant_id=tenant, plan=plan, tokens=10), Lease)
        # A holds 50,000; the bucket 549,980 and refilling at 10,000/s, up to 550,000 only
        await asyncio.sleep(0.25)  # time for 2,500 tokens of refill
        refused = await b.admit(tenant_id=tenant, plan=plan, tokens=551_000)
        assert isinstance(refused, Refusal) and refused.kind is LimitKind.TOKENS
        assert refused.levels.tokens is not None and refused.levels.tokens.level == 550_000
        # A's credit is still A's: admitted without a call
        assert isinstance(await a.admit(tenant_id=tenant, plan=plan, tokens=49_000), Lease)
        assert isinstance(await b.admit(tenant_id=tenant, plan=plan, tokens=549_000), Lease)
        refused = await b.admit(tenant_id=tenant, plan=plan, tokens=2_000)
        assert isinstance(refused, Refusal) and refused.kind is LimitKind.TOKENS
    finally:
        await a.close()
        await b.close()


async def test_credit_a_quiet_replica_holds_lapses_for_everyone(redis_url, client, tenant) -> None:
    a = RedisLimiter(url=redis_url, lease_s=30, credit_s=0.5)
    b = RedisLimiter(url=redis_url, lease_s=30, credit_s=0.5)
    plan = TenantPlan(tokens_per_minute=TPM)
    try:
        started = time.monotonic()
        for _ in range(2):
            assert isinstance(await a.admit(tenant_id=tenant, plan=plan, tokens=10), Lease)
        assert_held(client, tenant, TPM - 20 - 5_000, 5_000, started)
        # until Redis's clock passes the credit's deadline (A stopped using it 10% sooner)
        [record] = client.hvals(f"kvg:lim:{{{tenant}}}:lent")
        deadline_ms = int(record.split()[2])
        while redis_now_ms(client) <= deadline_ms:
            assert time.monotonic() - started < 10, "Redis's clock did not reach the deadline"
            await asyncio.sleep(0.02)
        assert isinstance(await b.admit(tenant_id=tenant, plan=plan, tokens=TPM - 100), Lease)
        before = scripts_run(client)
        refused = await a.admit(tenant_id=tenant, plan=plan, tokens=1_000)
        assert isinstance(refused, Refusal)  # A asked Redis: its lapsed credit is not used
        assert scripts_run(client) == before + 1
    finally:
        await a.close()
        await b.close()


async def test_a_replica_gives_back_its_credit_with_the_refunds_it_owes(
    redis_url, client, tenant
) -> None:
    limiter = RedisLimiter(url=redis_url, lease_s=30, credit_s=5)
    plan = TenantPlan(tokens_per_minute=TPM)
    started = time.monotonic()

    def assert_used(tokens: int) -> None:
        """What the tenant has used is all that is gone from the bucket (the rest refilled)."""
        assert_held(client, tenant, TPM - tokens, 0, started)

    try:
        first = await limiter.admit(tenant_id=tenant, plan=plan, tokens=1_000)
        second = await limiter.admit(tenant_id=tenant, plan=plan, tokens=1_000)  # takes credit
        assert isinstance(first, Lease) and isinstance(second, Lease)
        assert held(client, tenant)[1] == 50_000
        before = scripts_run(client)
        await limiter.release(first, unused_tokens=400)
        await limiter.release(second, unused_tokens=400)
        assert scripts_run(client) == before  # owed, not sent yet
        # more than the 50,000 held: the call gives them back with the 800 owed (and takes no
        # new credit: 5 s of refill would not cover another such request)
        assert isinstance(await limiter.admit(tenant_id=tenant, plan=plan, tokens=60_000), Lease)
        assert_used(2_000 - 800 + 60_000)
        third = await limiter.admit(tenant_id=tenant, plan=plan, tokens=1_000)
        assert isinstance(third, Lease) and held(client, tenant)[1] == 50_000
        await limiter.release(third, unused_tokens=300)
    finally:
        await limiter.close()  # gives back the 50,000 with the 300 owed
    assert_used(2_000 - 800 + 60_000 + 1_000 - 300)


async def test_a_tenant_seen_once_in_a_while_takes_no_credit(redis_url, client, tenant) -> None:
    """Credit for a tenant a replica sees once in a while would only lapse, out of every
    replica's reach: it is taken for a tenant this replica called for within its life."""
    limiter = RedisLimiter(url=redis_url, lease_s=30, credit_s=0.5)
    plan = TenantPlan(tokens_per_minute=TPM)
    try:
        for _ in range(2):
            assert isinstance(await limiter.admit(tenant_id=tenant, plan=plan, tokens=10), Lease)
            assert held(client, tenant)[1] == 0
            await asyncio.sleep(0.55)  # longer than the credit's life: not busy here
        assert isinstance(await limiter.admit(tenant_id=tenant, plan=plan, tokens=10), Lease)
        assert isinstance(await limiter.admit(tenant_id=tenant, plan=plan, tokens=10), Lease)
        assert held(client, tenant)[1] == 5_000  # busy: 0.5 s of 10,000 tokens per second
    finally:
        await limiter.close()


async def test_held_leases_are_extended_every_third_of_their_time_not_every_credit_period(
    redis_url, client, tenant
) -> None:
    """The refresh loop wakes every ``credit_s`` to let lapsed credit go; the leases it holds are
    still extended only every third of their time (one call per lease)."""
    limiter = RedisLimiter(url=redis_url, lease_s=30, credit_s=0.1)
    await limiter.start()
    try:
        lease = await limiter.admit(tenant_id=tenant, plan=TenantPlan(max_concurrency=2), tokens=1)
        assert isinstance(lease, Lease)
        before = scripts_run(client)
        await asyncio.sleep(0.55)  # five credit periods
        assert scripts_run(client) == before
    finally:
        await limiter.close()


async def test_a_release_run_twice_refunds_once(redis_url, client, tenant) -> None:
    """A retry whose first reply was lost, or the connection's replay, runs a release again: its
    tombstone makes the refund count once (credit returned counts once by its record)."""
    limiter = RedisLimiter(url=redis_url, lease_s=30, credit_s=0)
    plan = TenantPlan(tokens_per_minute=TPM)
    try:
        started = time.monotonic()
        lease = await limiter.admit(tenant_id=tenant, plan=plan, tokens=100_000)
        assert isinstance(lease, Lease)
        for _ in range(3):
            await limiter._release_one(lease, 60_000, abandoned=False)
        assert_held(client, tenant, TPM - 100_000 + 60_000, 0, started)
    finally:
        await limiter.close()


async def test_credit_lives_in_redis_as_long_as_the_longest_lender_says(
    redis_url, client, tenant
) -> None:
    """Replicas may run with different credit lives: one with a short life must not cut short
    the record of another's longer credit (the whole hash expiring with it)."""
    long_lived = RedisLimiter(url=redis_url, lease_s=30, credit_s=10)
    short_lived = RedisLimiter(url=redis_url, lease_s=30, credit_s=0.5)
    plan = TenantPlan(tokens_per_minute=TPM)
    lent_key = f"kvg:lim:{{{tenant}}}:lent"
    try:
        for limiter in (long_lived, long_lived, short_lived, short_lived):
            assert isinstance(await limiter.admit(tenant_id=tenant, plan=plan, tokens=10), Lease)
        assert held(client, tenant)[1] == 100_000 + 5_000
        assert client.pttl(lent_key) > 15_000  # the long credit's record lives 10 s
    finally:
        await long_lived.close()
        await short_lived.close()


async def test_refunds_of_lapsed_credit_go_back_even_when_leases_cannot_be_extended(
    redis_url, client, tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    limiter = RedisLimiter(url=redis_url, lease_s=0.6, credit_s=0.2)  # both every 0.2 s

    async def refresh_fails() -> None:
        raise RespError("ERR a lease refresh that keeps failing")

    monkeypatch.setattr(limiter, "refresh_held", refresh_fails)
    plan = TenantPlan(tokens_per_minute=TPM)
    await limiter.start()
    try:
        for _ in range(2):
            lease = await limiter.admit(tenant_id=tenant, plan=plan, tokens=1_000)
            assert isinstance(lease, Lease)
        await limiter.release(lease, unused_tokens=700)  # owed with the credit
        before = scripts_run(client)
        deadline = time.monotonic() + 10
        while scripts_run(client) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the loop sends it once the credit lapsed (0.18 s)
        assert scripts_run(client) == before + 1, "the refund was never sent"
        assert limiter._unreleased == {}  # ... and it arrived
        # (Redis refilled the bucket meanwhile about as much as the refund: the level says little)
        level = held(client, tenant)[0]
        assert level >= TPM - 2_000 - 2_000 + 700
    finally:
        await limiter.close()
