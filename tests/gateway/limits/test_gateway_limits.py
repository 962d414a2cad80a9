"""Limiter semantics (pure arithmetic, in-process limiter) and the Redis limiter: atomic and
exact under concurrency from several limiter instances, fail closed when Redis is down."""

from __future__ import annotations

import asyncio

import pytest
import redis

from gateway.domain import TenantPlan
from gateway.limits.base import Lease, LimiterUnavailable, LimitKind, Refusal, refilled, wait_s
from gateway.limits.memory_limiter import MemoryLimiter
from gateway.limits.redis_limiter import RedisLimiter
from kvguard.localservices import free_port


def test_bucket_arithmetic() -> None:
    assert refilled(None, None, capacity=60, now_ms=5) == 60.0
    assert refilled(0.0, 1_000, capacity=60, now_ms=2_000) == 1.0  # 1 per second
    assert refilled(59.5, 0, capacity=60, now_ms=60_000) == 60.0  # capped
    assert refilled(10.0, 5_000, capacity=60, now_ms=4_000) == 10.0  # clock never runs back
    assert wait_s(0.0, 1, capacity=3) == 20  # 3/min: one every 20 s
    assert wait_s(0.5, 1, capacity=60) == 1
    assert wait_s(0.0, 1, capacity=120_000) == 1  # never below one second


class FakeClock:
    def __init__(self) -> None:
        self.ms = 0

    def __call__(self) -> int:
        return self.ms


async def test_memory_limiter_requests_tokens_concurrency() -> None:
    clock = FakeClock()
    limiter = MemoryLimiter(clock_ms=clock)
    plan = TenantPlan(requests_per_minute=3, tokens_per_minute=100, max_concurrency=2)
    a = await limiter.admit(tenant_id="t", plan=plan, tokens=40)
    b = await limiter.admit(tenant_id="t", plan=plan, tokens=40)
    assert isinstance(a, Lease) and isinstance(b, Lease)
    assert await limiter.admit(tenant_id="t", plan=plan, tokens=1) == Refusal(
        LimitKind.CONCURRENCY, 1
    )
    await limiter.release(a, unused_tokens=30)  # 60 - 40 + 30 = 50 tokens left
    assert await limiter.admit(tenant_id="t", plan=plan, tokens=51) == Refusal(LimitKind.TOKENS, 1)
    c = await limiter.admit(tenant_id="t", plan=plan, tokens=50)
    assert isinstance(c, Lease)
    await limiter.release(c, unused_tokens=0)
    assert await limiter.admit(tenant_id="t", plan=plan, tokens=1) == Refusal(
        LimitKind.REQUESTS, 20
    )
    clock.ms = 20_000  # one request refilled
    d = await limiter.admit(tenant_id="t", plan=plan, tokens=1)
    assert isinstance(d, Lease)
    assert await limiter.admit(tenant_id="t", plan=plan, tokens=101) == Refusal(
        LimitKind.TOKENS, None
    )
    assert await limiter.admit(tenant_id="other", plan=plan, tokens=100) is not None


@pytest.fixture
async def redis_limiters(redis_url):
    limiters = [RedisLimiter(url=redis_url, lease_s=30) for _ in range(4)]
    yield limiters
    for limiter in limiters:
        await limiter.close()


async def test_redis_limiter_same_semantics(redis_limiters) -> None:
    limiter = redis_limiters[0]
    plan = TenantPlan(requests_per_minute=3, tokens_per_minute=100, max_concurrency=2)
    a = await limiter.admit(tenant_id="t", plan=plan, tokens=40)
    b = await limiter.admit(tenant_id="t", plan=plan, tokens=40)
    assert isinstance(a, Lease) and isinstance(b, Lease)
    assert await limiter.admit(tenant_id="t", plan=plan, tokens=1) == Refusal(
        LimitKind.CONCURRENCY, 1
    )
    await limiter.release(a, unused_tokens=30)
    refused = await limiter.admit(tenant_id="t", plan=plan, tokens=52)
    assert isinstance(refused, Refusal) and refused.kind is LimitKind.TOKENS
    assert isinstance(await limiter.admit(tenant_id="t", plan=plan, tokens=50), Lease)
    refused = await limiter.admit(tenant_id="t", plan=plan, tokens=1)
    assert isinstance(refused, Refusal) and refused.kind is LimitKind.CONCURRENCY
    await limiter.release(b, unused_tokens=0)
    assert await limiter.admit(tenant_id="t", plan=plan, tokens=1) == Refusal(
        LimitKind.REQUESTS, 20
    )
    assert await limiter.admit(tenant_id="t", plan=plan, tokens=101) == Refusal(
        LimitKind.TOKENS, None
    )


async def test_redis_limits_are_exact_across_instances(redis_limiters) -> None:
    plan = TenantPlan(requests_per_minute=17, tokens_per_minute=10_000)
    results = await asyncio.gather(
        *(redis_limiters[i % 4].admit(tenant_id="t", plan=plan, tokens=10) for i in range(80))
    )
    assert sum(isinstance(r, Lease) for r in results) == 17

    tokens_plan = TenantPlan(tokens_per_minute=1_000)
    results = await asyncio.gather(
        *(
            redis_limiters[i % 4].admit(tenant_id="u", plan=tokens_plan, tokens=70)
            for i in range(60)
        )
    )
    assert sum(isinstance(r, Lease) for r in results) == 14  # floor(1000 / 70)

    conc_plan = TenantPlan(max_concurrency=5)
    results = await asyncio.gather(
        *(redis_limiters[i % 4].admit(tenant_id="v", plan=conc_plan, tokens=1) for i in range(60))
    )
    leases = [r for r in results if isinstance(r, Lease)]
    assert len(leases) == 5
    await asyncio.gather(*(redis_limiters[1].release(lease, unused_tokens=0) for lease in leases))
    again = await asyncio.gather(
        *(redis_limiters[i % 4].admit(tenant_id="v", plan=conc_plan, tokens=1) for i in range(20))
    )
    assert sum(isinstance(r, Lease) for r in again) == 5


async def test_a_release_with_nothing_to_give_back_sends_nothing(redis_url) -> None:
    """A lease of a plan without a concurrency cap holds no slot; with no unused tokens to refund
    (or no token limit), its release would change nothing in Redis, so it sends nothing (a round
    trip of every such request). A refund or a slot still goes back (this replica holds no credit:
    what one holding credit owes goes with its next call, ``test_gateway_limits_credit``)."""
    limiter = RedisLimiter(url=redis_url, lease_s=30, credit_s=0)
    client = redis.Redis.from_url(redis_url)

    def scripts_run() -> int:
        return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    try:
        rpm, tpm = TenantPlan(requests_per_minute=100), TenantPlan(tokens_per_minute=1_000)
        no_limit = await limiter.admit(tenant_id="t", plan=rpm, tokens=10)
        all_used = await limiter.admit(tenant_id="t", plan=tpm, tokens=10)
        assert isinstance(no_limit, Lease) and isinstance(all_used, Lease)
        before = scripts_run()
        await limiter.release(no_limit, unused_tokens=5)  # no token limit: nothing to refund
        await limiter.release(all_used, unused_tokens=0)
        assert scripts_run() == before
        capped = TenantPlan(max_concurrency=1)
        refund = await limiter.admit(tenant_id="t", plan=tpm, tokens=10)
        slot = await limiter.admit(tenant_id="c", plan=capped, tokens=1)
        assert isinstance(refund, Lease) and isinstance(slot, Lease)
        before = scripts_run()
        await limiter.release(refund, unused_tokens=4)
        await limiter.release(slot, unused_tokens=0)
        assert scripts_run() == before + 2
        assert isinstance(await limiter.admit(tenant_id="c", plan=capped, tokens=1), Lease)
    finally:
        await limiter.close()
        client.close()


async def test_leases_expire_unless_refreshed(redis_url) -> None:
    holder = RedisLimiter(url=redis_url, lease_s=1.5)
    other = RedisLimiter(url=redis_url, lease_s=1.5)
    plan = TenantPlan(max_concurrency=1)
    try:
        kept = await holder.admit(tenant_id="kept", plan=plan, tokens=1)
        dropped = await holder.admit(tenant_id="dropped", plan=plan, tokens=1)
        assert isinstance(kept, Lease) and isinstance(dropped, Lease)
        holder._held.pop(dropped.lease_id)  # as if its gateway had died
        for _ in range(4):
            await asyncio.sleep(0.5)
            await holder.refresh_held()
        assert isinstance(await other.admit(tenant_id="kept", plan=plan, tokens=1), Refusal)
        assert isinstance(await other.admit(tenant_id="dropped", plan=plan, tokens=1), Lease)
    finally:
        await holder.close()
        await other.close()


async def test_redis_down_fails_closed() -> None:
    limiter = RedisLimiter(url=f"redis://127.0.0.1:{free_port()}/0", lease_s=30)
    try:
        assert await limiter.healthy() is False
        with pytest.raises(LimiterUnavailable):
            await limiter.admit(tenant_id="t", plan=TenantPlan(requests_per_minute=1), tokens=1)
        lease = Lease(tenant_id="t", lease_id="x", tokens=1, plan=TenantPlan(max_concurrency=1))
        await limiter.release(lease, unused_tokens=1)  # never raises: the deadline frees it
    finally:
        await limiter.close()


async def test_redis_keys_share_a_hash_tag_and_expire(redis_url, redis_limiters) -> None:
    plan = TenantPlan(requests_per_minute=5, tokens_per_minute=50, max_concurrency=2)
    await redis_limiters[0].admit(tenant_id="tn_1", plan=plan, tokens=5)
    client = redis.Redis.from_url(redis_url)
    keys = sorted(k.decode() for k in client.keys("*"))
    assert keys == [
        "kvg:lim:{tn_1}:leases",
        "kvg:lim:{tn_1}:requests",
        "kvg:lim:{tn_1}:tokens",
    ]
    assert all(0 < client.pttl(k) <= 120_000 for k in keys)
    client.close()


async def test_an_admit_cancelled_in_flight_gives_its_slot_back(redis_url) -> None:
    """The request went away while its admit was on the way to Redis: the admit may have run,
    so it is abandoned (released with a tombstone), not left holding the slot for a lease time."""
    limiter = RedisLimiter(url=redis_url, lease_s=60)
    plan = TenantPlan(max_concurrency=1)
    try:
        assert await limiter.healthy()  # the connection is open: the admit below is sent at once
        admitting = asyncio.create_task(limiter.admit(tenant_id="gone", plan=plan, tokens=1))
        await asyncio.sleep(0)  # the admit's command is written; its reply is awaited
        admitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admitting
        assert isinstance(await limiter.admit(tenant_id="gone", plan=plan, tokens=1), Lease)
    finally:
        await limiter.close()
