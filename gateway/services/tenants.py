"""Tenants: create (with a first key), find, list, enable/disable, change limits, usage.

Services take a session and keyword-only arguments; the caller owns the transaction.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from contracts.sql import utcnow
from gateway.db.models import RequestAudit, Tenant
from gateway.domain import TenantPlan
from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.lifecycle import TenantStatus, check_tenant_transition
from gateway.services.keys import IssuedKey, issue_key


@dataclass(frozen=True, slots=True)
class CreatedTenant:
    tenant: Tenant
    first_key: IssuedKey = field(repr=False)


def create_tenant(
    session: Session,
    *,
    name: str,
    plan: TenantPlan,
    synthetic: bool = False,
    canary_sample_rate: float = 0.0,
    key_name: str | None = None,
    key_expires_at: datetime | None = None,
) -> CreatedTenant:
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise Conflict(f"a tenant named '{name}' already exists", code="tenant_exists")
    _check_sample_rate(canary_sample_rate)
    tenant = Tenant(
        id=f"tn_{secrets.token_hex(8)}",
        name=name,
        status=TenantStatus.ACTIVE.value,
        synthetic=synthetic,
        canary_sample_rate=canary_sample_rate,
    )
    _apply_plan(tenant, plan)
    session.add(tenant)
    session.flush()
    key = issue_key(session, tenant_id=tenant.id, name=key_name, expires_at=key_expires_at)
    return CreatedTenant(tenant=tenant, first_key=key)


def get_tenant(session: Session, *, ref: str) -> Tenant:
    """A tenant by id (``tn_...``) or by name."""
    tenant = session.get(Tenant, ref) or session.scalar(select(Tenant).where(Tenant.name == ref))
    if tenant is None:
        raise NotFound(f"no tenant '{ref}'", code="tenant_not_found")
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.name)))


def tenant_ids(session: Session) -> list[str]:
    """Every tenant's id (the canary indexes every tenant's marker tags)."""
    return list(session.scalars(select(Tenant.id)))


def set_status(session: Session, *, tenant: Tenant, status: TenantStatus) -> Tenant:
    tenant.status = check_tenant_transition(TenantStatus(tenant.status), status).value
    tenant.updated_at = utcnow()
    return tenant


def set_plan(session: Session, *, tenant: Tenant, plan: TenantPlan) -> Tenant:
    _apply_plan(tenant, plan)
    tenant.updated_at = utcnow()
    return tenant


def set_canary(
    session: Session, *, tenant: Tenant, sample_rate: float | None, synthetic: bool | None
) -> Tenant:
    if sample_rate is not None:
        _check_sample_rate(sample_rate)
        tenant.canary_sample_rate = sample_rate
    if synthetic is not None:
        tenant.synthetic = synthetic
    tenant.updated_at = utcnow()
    return tenant


def plan_of(tenant: Tenant) -> TenantPlan:
    return TenantPlan(
        requests_per_minute=tenant.requests_per_minute,
        tokens_per_minute=tenant.tokens_per_minute,
        max_concurrency=tenant.max_concurrency,
        max_context_tokens=tenant.max_context_tokens,
    )


def _apply_plan(tenant: Tenant, plan: TenantPlan) -> None:
    for name in ("requests_per_minute", "tokens_per_minute", "max_concurrency"):
        value = getattr(plan, name)
        if value is not None and value <= 0:
            raise InvalidRequest(f"{name} must be positive (or null for no limit)", param=name)
    if plan.max_context_tokens is not None and plan.max_context_tokens <= 0:
        raise InvalidRequest("max_context_tokens must be positive", param="max_context_tokens")
    tenant.requests_per_minute = plan.requests_per_minute
    tenant.tokens_per_minute = plan.tokens_per_minute
    tenant.max_concurrency = plan.max_concurrency
    tenant.max_context_tokens = plan.max_context_tokens


def _check_sample_rate(rate: float) -> None:
    if not 0.0 <= rate <= 1.0:
        raise InvalidRequest("canary_sample_rate must be within [0, 1]", param="canary_sample_rate")


@dataclass(frozen=True, slots=True)
class OutcomeUsage:
    outcome: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class UsageSummary:
    tenant_id: str
    since: datetime | None
    until: datetime | None
    by_outcome: tuple[OutcomeUsage, ...]

    @property
    def requests(self) -> int:
        return sum(row.requests for row in self.by_outcome)

    @property
    def prompt_tokens(self) -> int:
        return sum(row.prompt_tokens for row in self.by_outcome)

    @property
    def completion_tokens(self) -> int:
        return sum(row.completion_tokens for row in self.by_outcome)


def usage(
    session: Session, *, tenant_id: str, since: datetime | None, until: datetime | None
) -> UsageSummary:
    """Request and token totals of one tenant (from the audit rows), per outcome."""
    query = (
        select(
            RequestAudit.outcome,
            func.count(),
            func.coalesce(func.sum(RequestAudit.prompt_tokens), 0),
            func.coalesce(func.sum(RequestAudit.completion_tokens), 0),
        )
        .where(RequestAudit.tenant_id == tenant_id)
        .group_by(RequestAudit.outcome)
        .order_by(RequestAudit.outcome)
    )
    if since is not None:
        query = query.where(RequestAudit.started_at >= since)
    if until is not None:
        query = query.where(RequestAudit.started_at < until)
    rows = tuple(
        OutcomeUsage(
            outcome=str(o),
            requests=int(n or 0),
            prompt_tokens=int(p or 0),
            completion_tokens=int(c or 0),
        )
        for o, n, p, c in session.execute(query).all()
    )
    return UsageSummary(tenant_id=tenant_id, since=since, until=until, by_outcome=rows)
