"""What an operator does, through the admin API or the console: one implementation of each action.

Each action changes state through the services (``tenants``, ``keys``, ``responses``, ``engines``,
``quarantine``) and records one ``admin_actions`` row (``gateway.services.actions``) naming the
channel it came through, in the same unit of work as the change wherever the change is a database
write. The engine actions then apply the change to this replica's registry at once (the others
converge on their next reload).

Tenant and key actions take the caller's session (the caller owns the transaction); engine actions
take the running gateway's state, because they also reload and poll its registry.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from contracts.sql import run_in_session
from gateway.db.models import ApiKey, Tenant
from gateway.domain import TenantPlan
from gateway.engines.registry import EngineControls, EngineRecord
from gateway.engines.spec import EngineSpec
from gateway.errors import InvalidRequest, NotFound
from gateway.lifecycle import TenantStatus
from gateway.services import actions
from gateway.services import engines as engine_service
from gateway.services import keys as key_service
from gateway.services import responses as response_store
from gateway.services import tenants as tenant_service
from gateway.services.actions import ActionKind, Channel
from gateway.state import GatewayState

log = logging.getLogger("kvguard.gateway.operator")

# -- tenants and keys ------------------------------------------------------------------------------


def create_tenant(
    session: Session,
    *,
    channel: Channel,
    name: str,
    plan: TenantPlan,
    synthetic: bool = False,
    canary_sample_rate: float = 0.0,
    key_name: str | None = None,
    key_expires_at: datetime | None = None,
) -> tenant_service.CreatedTenant:
    created = tenant_service.create_tenant(
        session,
        name=name,
        plan=plan,
        synthetic=synthetic,
        canary_sample_rate=canary_sample_rate,
        key_name=key_name,
        key_expires_at=key_expires_at,
    )
    detail = f"name={name}; first key {created.first_key.prefix}; {_plan_text(plan)}"
    actions.record(
        session,
        channel=channel,
        action=ActionKind.TENANT_CREATE,
        target=created.tenant.id,
        detail=detail,
    )
    return created


def update_tenant(
    session: Session,
    *,
    channel: Channel,
    ref: str,
    status: TenantStatus | None = None,
    limits: Mapping[str, int | None] | None = None,
    canary: tuple[float | None, bool | None] | None = None,
) -> Tenant:
    """Change what is given (``tenant_service.update_tenant``) and record what changed."""
    tenant = tenant_service.get_tenant(session, ref=ref)
    tenant_service.update_tenant(
        session, tenant=tenant, status=status, limits=limits, canary=canary
    )
    changed: list[str] = []
    if status is not None:
        changed.append(f"status={status.value}")
    changed += [f"{name}={_limit(value)}" for name, value in (limits or {}).items()]
    if canary is not None:
        changed += [f"canary_sample_rate={canary[0]}"] if canary[0] is not None else []
        changed += [f"synthetic={canary[1]}"] if canary[1] is not None else []
    actions.record(
        session,
        channel=channel,
        action=ActionKind.TENANT_UPDATE,
        target=tenant.id,
        detail="; ".join(changed) or "nothing",
    )
    return tenant


def erase_responses(session: Session, *, channel: Channel, ref: str) -> tuple[Tenant, int]:
    """Delete every stored response of a tenant now (an erasure request: the retention would keep
    them for days); the tenant and its keys stay. The tenant and how many responses went."""
    tenant = tenant_service.get_tenant(session, ref=ref)
    erased = response_store.forget_tenant(session, tenant_id=tenant.id)
    actions.record(
        session,
        channel=channel,
        action=ActionKind.TENANT_ERASE_RESPONSES,
        target=tenant.id,
        detail=f"{erased} stored responses erased",
    )
    return tenant, erased


def issue_key(
    session: Session,
    *,
    channel: Channel,
    ref: str,
    name: str | None = None,
    expires_at: datetime | None = None,
) -> key_service.IssuedKey:
    tenant = tenant_service.get_tenant(session, ref=ref)
    issued = key_service.issue_key(session, tenant_id=tenant.id, name=name, expires_at=expires_at)
    detail = f"tenant {tenant.id}" + ("" if expires_at is None else f"; expires {expires_at}")
    actions.record(
        session, channel=channel, action=ActionKind.KEY_ISSUE, target=issued.prefix, detail=detail
    )
    return issued


def revoke_key(session: Session, *, channel: Channel, prefix: str) -> ApiKey:
    row = key_service.revoke_key(session, prefix=prefix)
    detail = f"tenant {row.tenant_id}"
    actions.record(
        session, channel=channel, action=ActionKind.KEY_REVOKE, target=prefix, detail=detail
    )
    return row


def _limit(value: int | None) -> str:
    return "none" if value is None else str(value)


def _plan_text(plan: TenantPlan) -> str:
    limits = {name: getattr(plan, name) for name in tenant_service.LIMIT_FIELDS}
    return "; ".join(f"{n}={v}" for n, v in limits.items() if v is not None) or "no limits"


# -- engines ---------------------------------------------------------------------------------------


def engine_spec(raw: Mapping[str, Any]) -> EngineSpec:
    """An engine entry as the admin API and the console take it, validated like a configured one."""
    try:
        return EngineSpec.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid engine: {exc.errors()[0]['msg']}") from exc


def known(state: GatewayState, name: str) -> EngineRecord:
    record = state.registry.get(name)
    if record is None:
        raise NotFound(f"no engine '{name}'", code="engine_not_found")
    return record


async def register_engine(
    state: GatewayState, *, channel: Channel, spec: EngineSpec
) -> EngineRecord:
    taken = {record.name for record in state.registry.records()}

    def register(session: Session) -> None:
        engine_service.register_engine(session, spec=spec, taken=taken)
        detail = f"kind={spec.kind.value}; base_url={spec.base_url}; members={len(spec.members)}"
        actions.record(
            session,
            channel=channel,
            action=ActionKind.ENGINE_REGISTER,
            target=spec.name,
            detail=detail,
        )

    await run_in_session(state.sessions, register)
    await state.reload_engines()
    await state.poller.poll_once()
    return known(state, spec.name)


async def remove_engine(state: GatewayState, *, channel: Channel, name: str) -> None:
    def remove(session: Session) -> None:
        engine_service.remove_engine(session, name=name)
        actions.record(session, channel=channel, action=ActionKind.ENGINE_REMOVE, target=name)

    await run_in_session(state.sessions, remove)
    await state.reload_engines()


async def set_members(
    state: GatewayState, *, channel: Channel, name: str, members: Sequence[Mapping[str, Any]]
) -> EngineRecord:
    """Replace a registered group's members (each validated as in settings: a 400 names it)."""

    def replace(session: Session) -> None:
        spec = engine_service.set_members(session, name=name, members=members)
        detail = ", ".join(f"{m.name} {m.role.value} {m.url}" for m in spec.members) or "none"
        actions.record(
            session, channel=channel, action=ActionKind.ENGINE_MEMBERS, target=name, detail=detail
        )

    await run_in_session(state.sessions, replace)
    await state.reload_engines()
    await state.poller.poll_once()
    return known(state, name)


async def quarantine(
    state: GatewayState, *, channel: Channel, name: str, reason: str
) -> EngineRecord:
    """Take an engine out of routing everywhere (``Quarantines.impose``: it never waits on the
    database), then record it. Tightening isolation must not fail for want of its record: when the
    database cannot take it, the quarantine stands and the missing record is logged."""
    known(state, name)
    await state.quarantine(name, reason=reason)
    try:
        await run_in_session(
            state.sessions,
            lambda s: actions.record(
                s, channel=channel, action=ActionKind.ENGINE_QUARANTINE, target=name, reason=reason
            ),
        )
    except SQLAlchemyError as exc:
        log.error(
            "quarantine of %s imposed; its admin action not recorded (%s)", name, type(exc).__name__
        )
    return known(state, name)


async def clear_quarantine(
    state: GatewayState, *, channel: Channel, name: str, reason: str | None
) -> EngineRecord:
    """Lift a quarantine on every replica; the clear and its record commit together."""
    record = known(state, name)
    detail = f"was: {record.controls.quarantine_reason or 'not quarantined'}"
    await state.quarantines.clear(
        name,
        also=lambda s: actions.record(
            s,
            channel=channel,
            action=ActionKind.ENGINE_CLEAR,
            target=name,
            detail=detail,
            reason=reason,
        ),
    )
    return known(state, name)


async def set_override(
    state: GatewayState, *, channel: Channel, name: str, allow_unsafe: bool
) -> EngineRecord:
    known(state, name)

    def override(session: Session) -> EngineControls:
        controls = engine_service.set_allow_unsafe(session, name=name, allow=allow_unsafe)
        actions.record(
            session,
            channel=channel,
            action=ActionKind.ENGINE_OVERRIDE,
            target=name,
            detail=f"allow_unsafe={allow_unsafe}",
        )
        return controls

    controls = await run_in_session(state.sessions, override)
    # The override changes allow_unsafe alone: a quarantine in force here that the row did not
    # show yet (imposed or learned here, its row still to be written) stays.
    current = state.registry.get(name)
    if current is not None and controls.quarantine_reason is None:
        controls = EngineControls(current.controls.quarantine_reason, controls.allow_unsafe)
    state.registry.set_controls(name, controls)
    return known(state, name)
