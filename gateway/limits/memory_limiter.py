"""In-process limiter for the embedded default (no ``KVGUARD_REDIS_URL``): one gateway process.

Same buckets and leases as the Redis limiter (``gateway.limits.base``); atomic because ``admit``
never awaits between reading and writing state. Not for several replicas: production requires
Redis (settings refuse production without it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.domain import TenantPlan
from gateway.limits.base import (
    CONCURRENCY_RETRY_S,
    Lease,
    Limiter,
    LimitKind,
    Refusal,
    levels_of,
    refilled,
    tokens_never_fit,
    wait_s,
)


def _monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


@dataclass(slots=True)
class _TenantState:
    requests: tuple[float, int] | None = None  # (level, updated_ms)
    tokens: tuple[float, int] | None = None
    leases: set[str] = field(default_factory=set)


class MemoryLimiter(Limiter):
    backend = "memory"

    def __init__(self, *, clock_ms: Callable[[], int] = _monotonic_ms) -> None:
        self._clock_ms = clock_ms
        self._tenants: dict[str, _TenantState] = {}

    async def admit(self, *, tenant_id: str, plan: TenantPlan, tokens: int) -> Lease | Refusal:
        return self.admit_now(tenant_id=tenant_id, plan=plan, tokens=tokens)

    def admit_now(self, *, tenant_id: str, plan: TenantPlan, tokens: int) -> Lease | Refusal:
        if tokens_never_fit(plan, tokens):  # permanent: say so before any transient limit
            return Refusal(LimitKind.TOKENS, None)
        state = self._tenants.setdefault(tenant_id, _TenantState())
        now = self._clock_ms()
        rpm, tpm = plan.requests_per_minute, plan.tokens_per_minute
        rpm_level = (
            None if rpm is None else refilled(*_unpack(state.requests), capacity=rpm, now_ms=now)
        )
        tpm_level = (
            None if tpm is None else refilled(*_unpack(state.tokens), capacity=tpm, now_ms=now)
        )
        seen = levels_of(plan, rpm_level, tpm_level)
        if plan.max_concurrency is not None and len(state.leases) >= plan.max_concurrency:
            return Refusal(LimitKind.CONCURRENCY, CONCURRENCY_RETRY_S, seen)
        if rpm is not None and rpm_level is not None and rpm_level < 1:
            return Refusal(LimitKind.REQUESTS, wait_s(rpm_level, 1, capacity=rpm), seen)
        if tpm is not None and tpm_level is not None and tpm_level < tokens:
            return Refusal(LimitKind.TOKENS, wait_s(tpm_level, tokens, capacity=tpm), seen)
        if rpm_level is not None:
            rpm_level -= 1
            state.requests = (rpm_level, now)
        if tpm_level is not None:
            tpm_level -= tokens
            state.tokens = (tpm_level, now)
        lease = Lease(
            tenant_id=tenant_id,
            lease_id=uuid.uuid4().hex,
            tokens=tokens,
            plan=plan,
            levels=levels_of(plan, rpm_level, tpm_level),
        )
        if plan.max_concurrency is not None:
            state.leases.add(lease.lease_id)
        return lease

    async def release(self, lease: Lease, *, unused_tokens: int) -> None:
        state = self._tenants.get(lease.tenant_id)
        if state is None:
            return
        state.leases.discard(lease.lease_id)
        capacity = lease.plan.tokens_per_minute
        if capacity is not None and unused_tokens > 0 and state.tokens is not None:
            now = self._clock_ms()
            level = refilled(*state.tokens, capacity=capacity, now_ms=now)
            state.tokens = (min(float(capacity), level + unused_tokens), now)

    async def healthy(self) -> bool:
        return True

    def in_flight(self, tenant_id: str) -> int:
        state = self._tenants.get(tenant_id)
        return 0 if state is None else len(state.leases)


def _unpack(bucket: tuple[float, int] | None) -> tuple[float | None, int | None]:
    return (None, None) if bucket is None else bucket
