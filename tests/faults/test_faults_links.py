"""The pieces the fault scenarios stand on, with real Redis: the cuttable TCP link, and the Redis
limiter after an outage: it gives back a slot whose release failed while Redis was unreachable,
and the connections it pooled before the outage do not turn into spurious 503s."""

from __future__ import annotations

import asyncio

import redis

from bench.fault_stack import TcpLink
from gateway.domain import TenantPlan
from gateway.limits.base import Lease, LimiterUnavailable, Refusal
from gateway.limits.redis_limiter import RedisLimiter
from kvguard.localservices import RunningService


def test_link_refuses_and_resets_while_cut_then_forwards_again(redis_service: RunningService):
    link = TcpLink(redis_service.host, redis_service.port)
    try:
        client = redis.Redis(port=link.port, socket_timeout=2, socket_connect_timeout=2)
        assert client.ping()
        link.cut()
        try:
            client.ping()
            raise AssertionError("a cut link answered")
        except redis.ConnectionError:
            pass
        link.restore()
        assert client.ping()
    finally:
        link.close()


async def test_release_that_failed_during_an_outage_is_retried_when_redis_returns(
    redis_url: str, redis_service: RunningService
) -> None:
    link = TcpLink(redis_service.host, redis_service.port)
    limiter = RedisLimiter(url=f"redis://127.0.0.1:{link.port}/0", lease_s=60.0)
    plan = TenantPlan(requests_per_minute=None, tokens_per_minute=None, max_concurrency=1)
    try:
        lease = await limiter.admit(tenant_id="t1", plan=plan, tokens=10)
        assert isinstance(lease, Lease)
        link.cut()
        await limiter.release(lease, unused_tokens=0)  # fails: Redis is unreachable
        link.restore()
        # The only slot is free again at once, not a lease time (60 s) later.
        again = await limiter.admit(tenant_id="t1", plan=plan, tokens=10)
        assert isinstance(again, Lease), again
        refused = await limiter.admit(tenant_id="t1", plan=plan, tokens=10)
        assert not isinstance(refused, Lease)  # and the cap still holds
    finally:
        await limiter.close()
        link.close()


async def test_connections_pooled_before_an_outage_do_not_refuse_tenants_after_it(
    redis_url: str, redis_service: RunningService
) -> None:
    """The pool still holds connections the outage broke; using one must not be a 503."""
    link = TcpLink(redis_service.host, redis_service.port)
    limiter = RedisLimiter(url=f"redis://127.0.0.1:{link.port}/0", lease_s=60.0)
    plan = TenantPlan(requests_per_minute=None, tokens_per_minute=None, max_concurrency=3)

    async def admit() -> Lease | Refusal | LimiterUnavailable:
        try:
            return await limiter.admit(tenant_id="t2", plan=plan, tokens=10)
        except LimiterUnavailable as exc:
            return exc

    try:
        first = await asyncio.gather(admit(), admit(), admit())  # three pooled connections
        assert all(isinstance(lease, Lease) for lease in first), first
        for lease in first:
            assert isinstance(lease, Lease)
            await limiter.release(lease, unused_tokens=0)
        link.cut()
        assert isinstance(await admit(), LimiterUnavailable)  # fails closed while cut
        link.restore()
        after = await asyncio.gather(admit(), admit(), admit())
        assert all(isinstance(lease, Lease) for lease in after), after
    finally:
        await limiter.close()
        link.close()
