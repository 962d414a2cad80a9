"""Redis limiter: the same buckets and leases as ``gateway.limits.base``, atomic across replicas.

One Lua script admits (checks all three limits, then takes all or nothing) and one releases
(removes the lease, refunds tokens); a release that would change nothing (a plan without a
concurrency cap, no tokens to refund) is not sent. Both read the clock with Redis ``TIME``, so
gateway clocks never disagree. Commands go over ``contracts.resp`` (one pipelined
connection: a call costs a write and a reply). A tenant's keys share a hash tag (``{tenant}``),
so the scripts stay valid on a Redis Cluster. Buckets expire after two idle windows (a full
bucket needs no state). The admit script also returns the buckets' levels
(``gateway.limits.base.Levels``: the rate-limit headers) in the same reply.

Credit (plans without a concurrency cap). A call that admits for a tenant this replica called
for within ``credit_s`` (one busy here) may also take *credit*: up to
``credit_s`` seconds of each bucket's refill, taken only from the upper half of every bucket the
plan has, and recorded in Redis as lent to this replica until ``credit_s`` from then. The replica
admits the tenant's next requests from it without a call (for ``CREDIT_USE`` of that life, so a
Redis clock running a little fast never finds it used late), and owes the unused completion
tokens of those requests back. Its next call gives back what is left, with the refunds owed, and
may take new credit; credit nobody gives back lapses in Redis at its deadline. So:

- nothing is ever admitted twice over: a bucket refills only up to its capacity less the live
  credit lent out of it, so a bucket and all credit together never hold more than the plan;
- near a limit (the lower half of a bucket) every request is a call, checked as before, and
  credit taken earlier comes back with its replica's next call; a replica that has gone quiet
  lets its credit lapse within ``credit_s``, which is the most another replica can be refused
  early for credit held elsewhere;
- the ``x-ratelimit-*`` headers of a request admitted from credit are the buckets as its replica
  last saw them, refilled since, plus the credit it holds (up to the plan): other replicas' takes
  show on the next call, and a refill the bucket's ceiling (its capacity less the credit lent)
  held back may show early.

Leases carry deadlines; this process refreshes the ones it holds every third of the lease time,
so a gateway that dies frees its slots within one lease time. Any Redis error raises
``LimiterUnavailable`` from ``admit`` (the caller fails closed), unless the request fits the
credit held. A ``release`` that fails (Redis unreachable) is kept and retried before the next
admit and on every refresh, so the tenant gets its slots back as soon as Redis answers again
instead of a lease time later; the deadline stays the backstop.

An admit the gateway gave up on (a timeout: Redis frozen, its socket still open) may still run
when Redis resumes, and would hold a slot nobody releases. So it is *abandoned*: released like a
failed release (retried until Redis answers). Every release leaves a tombstone under the lease
id for one lease time, which the admit script checks first and a second run of the same release
(a retry whose first reply was lost, a replay) finds, refunding nothing again; credit given back,
and the refunds it owes, count only with its live record, which the first call deletes. For an
abandoned admit, whichever runs first, the slot ends free: a late admit finds the tombstone and
takes nothing; an earlier one is removed (and its tokens refunded). An abandoned admit of a plan
without a concurrency cap may keep its rate charge (nothing shows whether it ran): at most one
request's worth and the credit it asked for, which lapses. The credit and refunds such a call
gave back are never sent again (they may have been received): a failure can only leave a tenant
less, never more.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass

from contracts import grid
from contracts.resp import RespClient, RespError, Script
from gateway.domain import TenantPlan
from gateway.limits.base import (
    WINDOW_MS,
    Bucket,
    Lease,
    Levels,
    Limiter,
    LimiterUnavailable,
    LimitKind,
    Refusal,
    levels_of,
)
from gateway.limits.redis_scripts import ADMIT_LUA, REFRESH_LUA, RELEASE_LUA, keys_of

log = logging.getLogger("kvguard.gateway.limits")
MAX_UNRELEASED = 10_000  # releases kept for a retry; beyond, the oldest expire on their own
INLINE_RETRIES = 16  # retried before an admit (the refresh loop retries the rest)
_FAILURES = (RespError, OSError)  # an error reply; no connection, a broken one, a timeout
CREDIT_S = 1.0  # the life of a replica's credit in Redis, and how much it asks for (of the refill)
CREDIT_USE = 0.9  # the share of that life the replica uses it in (Redis's clock may run fast)


def _arg(value: int | None) -> str:
    return "" if value is None else str(value)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _levels(plan: TenantPlan, requests: object, tokens: object) -> Levels:
    """The script's level strings ('' = no such limit) as ``Levels``."""
    r, t = _text(requests), _text(tokens)
    return levels_of(plan, float(r) if r else None, float(t) if t else None)


@dataclass(slots=True)
class Credit:
    """What this replica holds of a tenant's buckets (already taken in Redis, see the module
    docstring), and the refunds it owes them."""

    credit_id: str
    plan: TenantPlan
    requests: int
    tokens: int
    until: float  # monotonic: used only before (the record in Redis lives longer)
    seen: Levels  # the buckets as the call that took it left them, this credit excluded
    seen_at: float
    refund: int = 0  # unused completion tokens owed back, sent with the next call

    def covers(self, plan: TenantPlan, tokens: int, now: float) -> bool:
        return (
            plan == self.plan
            and now < self.until
            and (plan.requests_per_minute is None or self.requests >= 1)
            and (plan.tokens_per_minute is None or self.tokens >= tokens)
        )

    def levels(self, now: float) -> Levels:
        """The buckets as this replica sees them: as last seen, refilled since, plus its credit."""
        elapsed_ms = (now - self.seen_at) * 1000

        def plus(bucket: Bucket | None, credit: int) -> Bucket | None:
            if bucket is None:
                return None
            refill = elapsed_ms * bucket.limit / WINDOW_MS
            return Bucket(bucket.limit, min(bucket.limit, bucket.level + refill + credit))

        return Levels(plus(self.seen.requests, self.requests), plus(self.seen.tokens, self.tokens))


def _wanted(plan: TenantPlan, tokens: int, credit_s: float) -> tuple[int, int]:
    """The credit to ask for: ``credit_s`` of each bucket's refill, none unless it covers at
    least one more such request under every limit the plan has."""
    if plan.max_concurrency is not None:
        return 0, 0  # every request holds a lease of its own in Redis
    rpm, tpm = plan.requests_per_minute, plan.tokens_per_minute
    want_r = 0 if rpm is None else int(rpm * credit_s * 1000 // WINDOW_MS)
    want_t = 0 if tpm is None else int(tpm * credit_s * 1000 // WINDOW_MS)
    if (rpm is not None and want_r < 1) or (tpm is not None and want_t < max(1, tokens)):
        return 0, 0
    return want_r, want_t


class RedisLimiter(Limiter):
    backend = "redis"

    def __init__(
        self, *, url: str, lease_s: float, timeout_s: float = 0.5, credit_s: float = CREDIT_S
    ) -> None:
        # contracts.resp: one pipelined connection; a call whose connection broke is tried
        # once more on a fresh one (after an outage the old one is dead). That is safe here: a
        # lease is added under its own id (ZADD again is a no-op), a release removes it by id and
        # refunds once (its tombstone), credit comes back once (its record);
        # at worst a replayed admit charges its rate buckets twice.
        self._client = RespClient(url, timeout_s=timeout_s)
        self._lease_ms = int(lease_s * 1000)
        self._credit_s = credit_s
        self._admit = Script(self._client, ADMIT_LUA)
        self._release = Script(self._client, RELEASE_LUA)
        self._refresh = Script(self._client, REFRESH_LUA)
        self._held: dict[str, Lease] = {}
        # lease id -> (lease, unused tokens, abandoned: an admit given up on, see the docstring)
        self._unreleased: dict[str, tuple[Lease, int, bool]] = {}
        self._credit: dict[str, Credit] = {}  # tenant id -> what this replica holds
        self._asking: set[str] = set()  # tenants whose credit call is on its way
        self._called: dict[str, float] = {}  # tenant id -> when this replica last called for it
        self._refresher: asyncio.Task[None] | None = None
        # lease and credit ids: unique across replicas (64 random bits) and in this one (a count);
        # only Redis sees them, and a count costs no system call per request
        self._id_prefix = os.urandom(8).hex()
        self._id_count = itertools.count()

    def _new_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_count):x}"

    async def admit(self, *, tenant_id: str, plan: TenantPlan, tokens: int) -> Lease | Refusal:
        now = time.monotonic()
        credit = self._credit.get(tenant_id)
        if credit is not None and credit.covers(plan, tokens, now):
            credit.requests -= 1
            credit.tokens -= tokens
            return Lease(tenant_id, self._new_id(), tokens, plan, credit.levels(now))
        return await self._admit_in_redis(tenant_id, plan, tokens, now)

    async def _admit_in_redis(
        self, tenant_id: str, plan: TenantPlan, tokens: int, now: float
    ) -> Lease | Refusal:
        lease = Lease(tenant_id=tenant_id, lease_id=self._new_id(), tokens=tokens, plan=plan)
        # The credit held is given back in this call (with the refunds it owes) and is never used
        # again, whatever becomes of the call: it may have run. Credit past its use here may be
        # gone from Redis, and its refunds with it: those go as a release of their own.
        back = self._credit.pop(tenant_id, None)
        if back is not None and now >= back.until:
            self._owe(tenant_id, back)
            back = None
        # credit only for a tenant this replica called for within its life: one that is busy here
        # (a tenant seen once in a while would leave credit to lapse, out of everyone's reach)
        busy = now - self._called.get(tenant_id, -math.inf) < self._credit_s
        self._called[tenant_id] = now
        want_r, want_t = (
            _wanted(plan, tokens, self._credit_s)
            if busy and tenant_id not in self._asking
            else (0, 0)
        )
        new_id = self._new_id() if want_r + want_t else ""
        args = [
            _arg(plan.requests_per_minute),
            _arg(plan.tokens_per_minute),
            _arg(plan.max_concurrency),
            str(tokens),
            lease.lease_id,
            str(self._lease_ms),
            str(WINDOW_MS),
            back.credit_id if back else "",
            str(back.requests if back else 0),
            str(back.tokens if back else 0),
            str(back.refund if back else 0),
            new_id,
            str(want_r),
            str(want_t),
            str(int(self._credit_s * 1000)),
        ]
        if new_id:
            self._asking.add(tenant_id)  # before any await: one credit call per tenant
        try:
            if self._unreleased:
                with contextlib.suppress(*_FAILURES):
                    await self._retry_releases(INLINE_RETRIES)  # first what an outage kept
            result = await self._admit(keys_of(tenant_id, lease.lease_id), args)
        except _FAILURES as exc:
            # It may still run when Redis answers: release it then (tombstoned).
            self._keep_unreleased(lease, tokens, abandoned=True)
            raise LimiterUnavailable(f"redis: {exc.__class__.__name__}") from exc
        except asyncio.CancelledError:
            # The request went away while the admit was on its way: it may have run.
            self._keep_unreleased(lease, tokens, abandoned=True)
            raise
        finally:
            if new_id:
                self._asking.discard(tenant_id)
        assert isinstance(result, list)
        if int(result[0]) == 1:
            levels = _levels(plan, result[1], result[2])
            got_r, got_t = int(result[3]), int(result[4])
            if got_r + got_t:
                credit = Credit(
                    new_id, plan, got_r, got_t, now + CREDIT_USE * self._credit_s, levels, now
                )
                self._credit[tenant_id] = credit
                levels = credit.levels(now)
            lease = Lease(tenant_id, lease.lease_id, tokens, plan, levels)
            if plan.max_concurrency is not None:
                self._held[lease.lease_id] = lease
            return lease
        kind_text = _text(result[1])
        if kind_text == "abandoned":
            raise LimiterUnavailable("redis: admit abandoned")
        wait_ms = int(result[2])
        retry = None if wait_ms < 0 else max(1, -(-wait_ms // 1000))
        return Refusal(LimitKind(kind_text), retry, _levels(plan, result[3], result[4]))

    async def release(self, lease: Lease, *, unused_tokens: int) -> None:
        self._held.pop(lease.lease_id, None)
        plan = lease.plan
        if plan.max_concurrency is None and (plan.tokens_per_minute is None or unused_tokens <= 0):
            return  # no slot was taken and nothing is refunded: the script would change nothing
        credit = self._credit.get(lease.tenant_id)
        if plan.max_concurrency is None and credit is not None:
            credit.refund += unused_tokens  # sent with the tenant's next call, or by the flush
            return
        try:
            await self._release_one(lease, unused_tokens, abandoned=False)
        except _FAILURES:
            # Kept for a retry: without it the slot stays taken until the lease's deadline.
            self._keep_unreleased(lease, unused_tokens, abandoned=False)
            log.warning(
                "lease release failed for tenant %s; retrying when Redis answers", lease.tenant_id
            )

    async def _release_one(
        self, lease: Lease, unused_tokens: int, *, abandoned: bool, back: Credit | None = None
    ) -> None:
        """End ``lease`` (refunding ``unused_tokens``; tombstoned if ``abandoned``), or, with
        ``back``, give that credit back and send the refunds it owes."""
        plan = lease.plan
        args = [_arg(plan.requests_per_minute), _arg(plan.tokens_per_minute)]
        args += [str(max(0, unused_tokens)), lease.lease_id, str(WINDOW_MS)]
        args += [str(self._lease_ms), "1" if abandoned else ""]
        if back is None:
            args += ["", "0", "0"]
        else:
            args += [back.credit_id, str(back.requests), str(back.tokens)]
        await self._release(keys_of(lease.tenant_id, lease.lease_id), args)

    def _keep_unreleased(self, lease: Lease, unused_tokens: int, *, abandoned: bool) -> None:
        self._unreleased[lease.lease_id] = (lease, unused_tokens, abandoned)
        while len(self._unreleased) > MAX_UNRELEASED:  # the oldest expire on their own
            self._unreleased.pop(next(iter(self._unreleased)))

    async def _retry_releases(self, limit: int | None = None) -> None:
        """Releases that failed earlier and abandoned admits, oldest first (at most ``limit``);
        raises (keeping the rest) on an error."""
        for lease_id, (lease, unused_tokens, abandoned) in list(self._unreleased.items())[:limit]:
            await self._release_one(lease, unused_tokens, abandoned=abandoned)
            self._unreleased.pop(lease_id, None)

    async def flush_credit(self, *, every: bool = False) -> None:
        """Forget the credit that can no longer be used, sending the refunds it owes (Redis drops
        its record when its life ends); with ``every``, give back all of it, live or not."""
        now = time.monotonic()
        for tenant_id, called in list(self._called.items()):
            if now - called >= self._credit_s:
                del self._called[tenant_id]
        for tenant_id, credit in list(self._credit.items()):
            if not every and now < credit.until:
                continue
            del self._credit[tenant_id]
            if every and now < credit.until:
                refund = Lease(tenant_id, self._new_id(), 0, credit.plan)
                await self._release_one(refund, credit.refund, abandoned=False, back=credit)
            else:
                self._owe(tenant_id, credit)
        await self._retry_releases()

    def _owe(self, tenant_id: str, credit: Credit) -> None:
        """The refunds of credit that lapsed, as a release of their own: a lease with no slot,
        kept (and retried) like a failed release; its tombstone makes it count once."""
        if credit.refund > 0:
            refund = Lease(tenant_id, self._new_id(), 0, credit.plan)
            self._keep_unreleased(refund, credit.refund, abandoned=False)

    async def healthy(self) -> bool:
        try:
            return await self._client.execute("PING") == b"PONG"
        except _FAILURES:
            return False

    async def refresh_held(self) -> None:
        """Extend every lease this process holds (one write for all of them)."""
        if not self._held:
            return
        commands = [
            self._refresh.command(
                [keys_of(lease.tenant_id, lease.lease_id)[2]], [lease.lease_id, self._lease_ms]
            )
            for lease in list(self._held.values())
        ]
        replies = await self._client.pipeline(commands)
        if any(isinstance(r, RespError) and str(r).startswith("NOSCRIPT") for r in replies):
            await self._refresh.load()
            replies = await self._client.pipeline(commands)
        for reply in replies:
            if isinstance(reply, RespError):
                raise reply

    async def _refresh_loop(self) -> None:
        """Every third of the lease time the leases held are extended; every ``credit_s`` (if
        sooner) the credit that lapsed is forgotten and its refunds sent, with failed releases."""
        third = self._lease_ms / 3000
        period = min(third, self._credit_s or math.inf)
        refreshed = time.monotonic()
        while True:
            await grid.sleep(period)
            try:
                if time.monotonic() - refreshed >= third - period / 2:
                    await self.refresh_held()
                    refreshed = time.monotonic()
            except _FAILURES:
                log.warning("lease refresh failed; retrying")
            try:  # apart: a lease that cannot be extended must not hold back the refunds
                await self.flush_credit()
            except _FAILURES:
                log.warning("sending the refunds of lapsed credit failed; retrying")

    async def start(self) -> list[asyncio.Task[None]]:
        self._refresher = asyncio.create_task(self._refresh_loop(), name="lease-refresh")
        return [self._refresher]

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # an error was reported
                await self._refresher
        with contextlib.suppress(*_FAILURES):
            await self.flush_credit(every=True)  # the credit held and the refunds owed
        await self._client.close()
