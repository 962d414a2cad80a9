"""Tenants: create (with a first key), find, list, enable/disable, change limits, usage.

Usage is read from the request audit (``RequestAudit``): requests and tokens per outcome, and the
refusals (every ending but ``completed``) per error code.

Services take a session and keyword-only arguments; the caller owns the transaction.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from contracts.sql import utcnow
from gateway.db.models import RequestAudit, Tenant
from gateway.domain import TenantPlan
from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.lifecycle import Phase, TenantStatus, check_tenant_transition
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


LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrency", "max_context_tokens")


def update_tenant(
    session: Session,
    *,
    tenant: Tenant,
    status: TenantStatus | None = None,
    limits: Mapping[str, int | None] | None = None,
    canary: tuple[float | None, bool | None] | None = None,
) -> Tenant:
    """Change only what is given: the status, the limits named in ``limits`` (None removes that
    limit), the canary's (sample rate, synthetic) where ``canary`` is given."""
    if status is not None:
        set_status(session, tenant=tenant, status=status)
    if limits:
        unknown = set(limits) - set(LIMIT_FIELDS)
        if unknown:
            raise InvalidRequest(f"unknown limit {sorted(unknown)[0]}", param=sorted(unknown)[0])
        current = plan_of(tenant)
        merged = {name: limits.get(name, getattr(current, name)) for name in LIMIT_FIELDS}
        set_plan(session, tenant=tenant, plan=TenantPlan(**merged))
    if canary is not None:
        set_canary(session, tenant=tenant, sample_rate=canary[0], synthetic=canary[1])
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


UsageQuery = Select[str, str, int, int | None, int | None]  # tenant, outcome, requests, tokens


def _usage_query(since: datetime | None, until: datetime | None) -> UsageQuery:
    query = select(
        RequestAudit.tenant_id,
        RequestAudit.outcome,
        func.count(),
        func.coalesce(func.sum(RequestAudit.prompt_tokens), 0),
        func.coalesce(func.sum(RequestAudit.completion_tokens), 0),
    ).group_by(RequestAudit.tenant_id, RequestAudit.outcome)
    if since is not None:
        query = query.where(RequestAudit.started_at >= since)
    if until is not None:
        query = query.where(RequestAudit.started_at < until)
    return query.order_by(RequestAudit.tenant_id, RequestAudit.outcome)


def usage(
    session: Session, *, tenant_id: str, since: datetime | None, until: datetime | None
) -> UsageSummary:
    """Request and token totals of one tenant (from the audit rows), per outcome."""
    query = _usage_query(since, until).where(RequestAudit.tenant_id == tenant_id)
    found = _summaries(session, query, since=since, until=until)
    return found.get(tenant_id) or UsageSummary(tenant_id, since, until, ())


def usage_by_tenant(
    session: Session, *, since: datetime | None, until: datetime | None = None
) -> dict[str, UsageSummary]:
    """Every tenant's totals (tenants without audit rows in the window are absent)."""
    return _summaries(session, _usage_query(since, until), since=since, until=until)


def _summaries(
    session: Session,
    query: UsageQuery,
    *,
    since: datetime | None,
    until: datetime | None,
) -> dict[str, UsageSummary]:
    rows: dict[str, list[OutcomeUsage]] = {}
    for tenant_id, o, n, p, c in session.execute(query).all():
        rows.setdefault(str(tenant_id), []).append(
            OutcomeUsage(
                outcome=str(o),
                requests=int(n or 0),
                prompt_tokens=int(p or 0),
                completion_tokens=int(c or 0),
            )
        )
    return {t: UsageSummary(t, since, until, tuple(found)) for t, found in rows.items()}


def refusals_by_tenant(
    session: Session, *, since: datetime | None, tenant_id: str | None = None
) -> dict[str, list[tuple[str, int]]]:
    """tenant id -> [(error code, requests)] of every request that did not complete (refused,
    failed, cut, cancelled), most frequent first; of one tenant when ``tenant_id`` is given."""
    code = func.coalesce(RequestAudit.error_code, RequestAudit.outcome)
    query = (
        select(RequestAudit.tenant_id, code, func.count())
        .where(RequestAudit.outcome != Phase.COMPLETED.value)
        .group_by(RequestAudit.tenant_id, code)
    )
    if since is not None:
        query = query.where(RequestAudit.started_at >= since)
    if tenant_id is not None:
        query = query.where(RequestAudit.tenant_id == tenant_id)
    found: dict[str, list[tuple[str, int]]] = {}
    for tenant_id, reason, n in session.execute(query).all():
        found.setdefault(str(tenant_id), []).append((str(reason), int(n)))
    for reasons in found.values():
        reasons.sort(key=lambda item: (-item[1], item[0]))
    return found
