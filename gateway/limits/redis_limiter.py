"""Redis limiter: the same buckets and leases as ``gateway.limits.base``, atomic across replicas.

One Lua script admits (checks all three limits, then takes all or nothing) and one releases
(removes the lease, refunds tokens); a release that would change nothing (a plan without a
concurrency cap, no tokens to refund) is not sent. Both read the clock with Redis ``TIME``, so
gateway clocks never disagree. Commands go over ``contracts.resp`` (one pipelined
connection: a request's admit and release cost a write and a reply each). A tenant's keys share
a hash tag (``{tenant}``), so the scripts stay valid on a Redis Cluster. Buckets expire after
two idle windows (a full bucket needs no state). The admit script also returns the buckets'
levels (``gateway.limits.base.Levels``: the rate-limit headers) in the same reply.

Leases carry deadlines; this process refreshes the ones it holds every third of the lease time,
so a gateway that dies frees its slots within one lease time. Any Redis error raises
``LimiterUnavailable`` from ``admit`` (the caller fails closed). A ``release`` that fails (Redis
unreachable) is kept and retried before the next admit and on every refresh, so the tenant gets
its slots back as soon as Redis answers again instead of a lease time later; the deadline stays
the backstop.

An admit the gateway gave up on (a timeout: Redis frozen, its socket still open) may still run
when Redis resumes, and would hold a slot nobody releases. So it is *abandoned*: released like a
failed release (retried until Redis answers), and that release also leaves a tombstone under the
lease id for one lease time, which the admit script checks first. Whichever runs first, the slot
ends free: a late admit finds the tombstone and takes nothing; an earlier one is removed (and its
tokens refunded). An abandoned admit of a plan without a concurrency cap may keep its rate charge
(nothing shows whether it ran): at most one request's worth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from contracts.resp import RespClient, RespError, Script
from gateway.domain import TenantPlan
from gateway.limits.base import (
    WINDOW_MS,
    Lease,
    Levels,
    Limiter,
    LimiterUnavailable,
    LimitKind,
    Refusal,
    levels_of,
)

log = logging.getLogger("kvguard.gateway.limits")
MAX_UNRELEASED = 10_000  # releases kept for a retry; beyond, the oldest expire on their own
INLINE_RETRIES = 16  # retried before an admit (the refresh loop retries the rest)
_FAILURES = (RespError, OSError)  # an error reply; no connection, a broken one, a timeout

_LEVEL = """
local function level(key, cap, now, window)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return cap end
  local elapsed = now - tonumber(v[2])
  if elapsed < 0 then elapsed = 0 end
  local lvl = tonumber(v[1]) + elapsed * cap / window
  if lvl > cap then lvl = cap end
  return lvl
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: requests bucket, tokens bucket, lease zset, the lease's tombstone.
# ARGV: rpm cap, tpm cap, concurrency cap ('' = no limit), cost, lease id, lease ms, window ms.
# Returns {1, rpm level, tpm level} admitted (the levels after the take), or {0, kind, wait_ms,
# rpm level, tpm level} (the levels as found; wait_ms -1: can never fit; kind 'abandoned': the
# gateway gave this admit up before it ran). A level is a string ('' = no such limit): Redis would
# truncate a Lua number to an integer.
ADMIT_LUA = (
    _LEVEL
    + """
if redis.call('EXISTS', KEYS[4]) == 1 then return {0, 'abandoned', -1, '', ''} end
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, lease = tonumber(ARGV[4]), ARGV[5]
local lease_ms, window = tonumber(ARGV[6]), tonumber(ARGV[7])
if tpm and cost > tpm then return {0, 'tokens', -1, '', ''} end
local rpm_level, tpm_level
if rpm then rpm_level = level(KEYS[1], rpm, now, window) end
if tpm then tpm_level = level(KEYS[2], tpm, now, window) end
local function levels(r, t)
  return r and tostring(r) or '', t and tostring(t) or ''
end
local seen_r, seen_t = levels(rpm_level, tpm_level)
if conc then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then return {0, 'concurrency', 1000, seen_r, seen_t} end
end
if rpm and rpm_level < 1 then
  return {0, 'requests', math.ceil((1 - rpm_level) * window / rpm), seen_r, seen_t}
end
if tpm and tpm_level < cost then
  return {0, 'tokens', math.ceil((cost - tpm_level) * window / tpm), seen_r, seen_t}
end
if rpm then
  rpm_level = rpm_level - 1
  redis.call('HSET', KEYS[1], 'level', tostring(rpm_level), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], 2 * window)
end
if tpm then
  tpm_level = tpm_level - cost
  redis.call('HSET', KEYS[2], 'level', tostring(tpm_level), 'ts', now)
  redis.call('PEXPIRE', KEYS[2], 2 * window)
end
if conc then
  redis.call('ZADD', KEYS[3], now + lease_ms, lease)
  redis.call('PEXPIRE', KEYS[3], 2 * lease_ms)
end
local after_r, after_t = levels(rpm_level, tpm_level)
return {1, after_r, after_t}
"""
)

# KEYS: tokens bucket, lease zset, the lease's tombstone.
# ARGV: tpm cap ('' = none), refund, lease id, window ms, tombstone ms ('' = a normal release).
# An abandoned admit's release leaves the tombstone and refunds only a lease it removed.
RELEASE_LUA = (
    _LEVEL
    + """
local removed = redis.call('ZREM', KEYS[2], ARGV[3])
local tpm, refund, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
if ARGV[5] ~= '' then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[5])
  if removed == 0 then refund = 0 end
end
if tpm and refund > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  local lvl = level(KEYS[1], tpm, now, window) + refund
  if lvl > tpm then lvl = tpm end
  redis.call('HSET', KEYS[1], 'level', tostring(lvl), 'ts', now)
end
return 1
"""
)

# KEYS: lease zset. ARGV: lease id, lease ms. Extends a lease that still exists.
REFRESH_LUA = (
    _LEVEL
    + """
return redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
"""
)


def _keys(tenant_id: str) -> tuple[str, str, str]:
    base = f"kvg:lim:{{{tenant_id}}}"
    return f"{base}:requests", f"{base}:tokens", f"{base}:leases"


def _tombstone(lease: Lease) -> str:
    return f"kvg:lim:{{{lease.tenant_id}}}:gone:{lease.lease_id}"


def _arg(value: int | None) -> str:
    return "" if value is None else str(value)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _levels(plan: TenantPlan, requests: object, tokens: object) -> Levels:
    """The script's level strings ('' = no such limit) as ``Levels``."""
    r, t = _text(requests), _text(tokens)
    return levels_of(plan, float(r) if r else None, float(t) if t else None)


class RedisLimiter(Limiter):
    backend = "redis"

    def __init__(self, *, url: str, lease_s: float, timeout_s: float = 0.5) -> None:
        # contracts.resp: one pipelined connection; a call whose connection broke is tried
        # once more on a fresh one (after an outage the old one is dead). That is safe here: a
        # lease is added under its own id (ZADD again is a no-op) and a release removes it by id;
        # at worst a replayed admit charges its rate buckets twice.
        self._client = RespClient(url, timeout_s=timeout_s)
        self._lease_ms = int(lease_s * 1000)
        self._admit = Script(self._client, ADMIT_LUA)
        self._release = Script(self._client, RELEASE_LUA)
        self._refresh = Script(self._client, REFRESH_LUA)
        self._held: dict[str, Lease] = {}
        # lease id -> (lease, unused tokens, abandoned: an admit given up on, see the docstring)
        self._unreleased: dict[str, tuple[Lease, int, bool]] = {}
        self._refresher: asyncio.Task[None] | None = None

    async def admit(self, *, tenant_id: str, plan: TenantPlan, tokens: int) -> Lease | Refusal:
        # 128 random bits as 32 hex digits (uuid4's length, without building a UUID)
        lease = Lease(tenant_id=tenant_id, lease_id=os.urandom(16).hex(), tokens=tokens, plan=plan)
        args = [
            _arg(plan.requests_per_minute),
            _arg(plan.tokens_per_minute),
            _arg(plan.max_concurrency),
            str(tokens),
            lease.lease_id,
            str(self._lease_ms),
            str(WINDOW_MS),
        ]
        if self._unreleased:
            with contextlib.suppress(*_FAILURES):
                await self._retry_releases(INLINE_RETRIES)  # first give back what an outage kept
        try:
            result = await self._admit([*_keys(tenant_id), _tombstone(lease)], args)
        except _FAILURES as exc:
            # It may still run when Redis answers: release it then (tombstoned).
            self._keep_unreleased(lease, tokens, abandoned=True)
            raise LimiterUnavailable(f"redis: {exc.__class__.__name__}") from exc
        except asyncio.CancelledError:
            # The request went away while the admit was on its way: it may have run.
            self._keep_unreleased(lease, tokens, abandoned=True)
            raise
        assert isinstance(result, list)
        if int(result[0]) == 1:
            levels = _levels(plan, result[1], result[2])
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
        try:
            await self._release_one(lease, unused_tokens, abandoned=False)
        except _FAILURES:
            # Kept for a retry: without it the slot stays taken until the lease's deadline.
            self._keep_unreleased(lease, unused_tokens, abandoned=False)
            log.warning(
                "lease release failed for tenant %s; retrying when Redis answers", lease.tenant_id
            )

    async def _release_one(self, lease: Lease, unused_tokens: int, *, abandoned: bool) -> None:
        _, tokens_key, leases_key = _keys(lease.tenant_id)
        args = [_arg(lease.plan.tokens_per_minute), str(max(0, unused_tokens)), lease.lease_id]
        args += [str(WINDOW_MS), str(self._lease_ms) if abandoned else ""]
        await self._release([tokens_key, leases_key, _tombstone(lease)], args)

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
            self._refresh.command([_keys(lease.tenant_id)[2]], [lease.lease_id, self._lease_ms])
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
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            try:
                await self.refresh_held()
                await self._retry_releases()
            except _FAILURES:
                log.warning("lease refresh failed; retrying")

    async def start(self) -> None:
        self._refresher = asyncio.create_task(self._refresh_loop(), name="lease-refresh")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await self._client.close()
