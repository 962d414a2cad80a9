"""Per-tenant limits: the limiter contract and the token-bucket arithmetic both limiters share.

Three limits, checked and taken atomically together:

- requests/min and tokens/min are token buckets holding up to one minute's allowance and
  refilling continuously (``capacity / 60 s``). A fresh bucket is full. A request takes 1 from
  the request bucket and ``prompt + max_tokens`` from the token bucket (OpenAI counts
  ``max_tokens`` the same way); unused completion tokens are refunded when the request ends.
- concurrency is a set of leases with deadlines; a lease is removed on release and, should a
  gateway die holding it, expires on its own (holders refresh it while the request lives).

Lifecycle of a lease: ``admit`` -> ``Lease`` (or a ``Refusal``) -> ``release`` exactly once.
The arithmetic here is pure (time is passed in) and mirrored line by line by the Redis Lua script.

Every answer of ``admit`` carries the buckets' ``Levels`` as that same take saw them (after it, for
a lease; unchanged, for a refusal): the ``x-ratelimit-*`` headers OpenAI sends are made from them
(``rate_limit_headers``), at no extra round trip.
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.domain import TenantPlan

WINDOW_MS = 60_000
CONCURRENCY_RETRY_S = 1


class LimitKind(StrEnum):
    CONCURRENCY = "concurrency"
    REQUESTS = "requests"
    TOKENS = "tokens"


@dataclass(frozen=True, slots=True)
class Bucket:
    """One per-minute limit's bucket: its capacity and its level (what is left now)."""

    limit: int
    level: float

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level))

    def reset_ms(self) -> int:
        """Milliseconds until the bucket is full again (OpenAI's "resets to its initial state")."""
        missing = max(0.0, self.limit - self.level)
        return math.ceil(missing * WINDOW_MS / self.limit)


@dataclass(frozen=True, slots=True)
class Levels:
    requests: Bucket | None = None  # None: the plan has no such limit
    tokens: Bucket | None = None


def levels_of(plan: TenantPlan, requests: float | None, tokens: float | None) -> Levels:
    rpm, tpm = plan.requests_per_minute, plan.tokens_per_minute
    return Levels(
        requests=None if rpm is None or requests is None else Bucket(rpm, requests),
        tokens=None if tpm is None or tokens is None else Bucket(tpm, tokens),
    )


@dataclass(frozen=True, slots=True)
class Lease:
    tenant_id: str
    lease_id: str
    tokens: int
    plan: TenantPlan
    levels: Levels = field(default_factory=Levels, compare=False)  # after this request's take


@dataclass(frozen=True, slots=True)
class Refusal:
    kind: LimitKind
    retry_after_s: int | None  # None: this request can never fit the plan (e.g. > tokens/min)
    levels: Levels = field(default_factory=Levels, compare=False)  # as the refused take saw them


class LimiterUnavailable(RuntimeError):
    """The shared limiter cannot be reached: limited tenants are refused (fail closed)."""


class Limiter(ABC):
    backend: str

    @abstractmethod
    async def admit(self, *, tenant_id: str, plan: TenantPlan, tokens: int) -> Lease | Refusal:
        """Take one request, ``tokens`` tokens and a concurrency slot, all or nothing."""

    @abstractmethod
    async def release(self, lease: Lease, *, unused_tokens: int) -> None:
        """Free the concurrency slot and refund ``unused_tokens`` (never raises)."""

    @abstractmethod
    async def healthy(self) -> bool: ...

    async def start(self) -> list[asyncio.Task[None]]:
        """Start background work (lease refresh) and return its tasks, for the gateway to watch
        (``close`` stops them); default none."""
        return []

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Stop background work and close clients; default none."""


def refilled(level: float | None, updated_ms: int | None, *, capacity: int, now_ms: int) -> float:
    """A bucket's level at ``now_ms``: full when new, refilled linearly, capped at capacity."""
    if level is None or updated_ms is None:
        return float(capacity)
    elapsed = max(0, now_ms - updated_ms)
    return min(float(capacity), level + elapsed * capacity / WINDOW_MS)


def wait_s(level: float, need: float, *, capacity: int) -> int:
    """Whole seconds until the bucket holds ``need`` (at least 1)."""
    wait_ms = math.ceil((need - level) * WINDOW_MS / capacity)
    return max(1, math.ceil(wait_ms / 1000))


def tokens_never_fit(plan: TenantPlan, tokens: int) -> bool:
    return plan.tokens_per_minute is not None and tokens > plan.tokens_per_minute


def duration(ms: int) -> str:
    """A duration as OpenAI writes its ``x-ratelimit-reset-*`` headers (Go's format: ``20ms``,
    ``1s``, ``1.5s``, ``6m0s``, ``1h0m0s``), to the millisecond."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


def rate_limit_headers(levels: Levels) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers, for the limits
    the plan has."""
    headers = {}
    for name, bucket in (("requests", levels.requests), ("tokens", levels.tokens)):
        if bucket is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining)
            headers[f"x-ratelimit-reset-{name}"] = duration(bucket.reset_ms())
    return headers
