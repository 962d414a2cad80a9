"""Typed messages shared by the gateway's layers: a tenant's plan and an authenticated caller.

Pure: no I/O, no framework imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class TenantPlan:
    """Per-tenant limits; ``None`` means no limit of that kind."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    max_context_tokens: int | None = None

    @property
    def rate_limited(self) -> bool:
        """Whether any limit needs the shared limiter (max_context is checked locally)."""
        return any(
            limit is not None
            for limit in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrency)
        )


@dataclass(frozen=True, slots=True)
class Principal:
    """The tenant behind a valid key, as the request path needs it."""

    tenant_id: str
    tenant_name: str
    key_id: int
    key_prefix: str
    plan: TenantPlan
    synthetic: bool
    canary_sample_rate: float
    key_last_used_at: datetime | None
    key_expires_at: datetime | None = None
