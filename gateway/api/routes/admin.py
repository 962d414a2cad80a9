"""Admin API (``/admin``): tenants, keys, limits, usage, erasing a tenant's stored responses,
engines. Admin token only.

Every change goes through ``gateway.services.operator`` -- the console's actions call the same
functions -- and is recorded in the admin actions under the channel ``admin_api``.

Plain ``def`` routes: FastAPI runs them in its threadpool, next to the synchronous DB session.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from fastapi import APIRouter, status

from contracts.sql import utcnow
from gateway.api.engine_views import engine_out
from gateway.api.schemas_admin import (
    ClearQuarantineIn,
    EngineIn,
    EngineOut,
    IssuedKeyOut,
    KeyCreate,
    KeyOut,
    MembersIn,
    OverrideIn,
    QuarantineIn,
    ResponsesErasedOut,
    TenantCreate,
    TenantCreated,
    TenantOut,
    TenantUpdate,
    UsageOut,
)
from gateway.api.timestamps import Instant
from gateway.api.usage import usage_out
from gateway.deps import AdminDep, SessionDep, StateDep
from gateway.domain import TenantPlan
from gateway.engines.registry import EngineRecord
from gateway.services import keys as key_service
from gateway.services import operator
from gateway.services import tenants as tenant_service
from gateway.services.actions import Channel
from gateway.state import GatewayState

router = APIRouter(prefix="/admin", tags=["admin"])
API = Channel.ADMIN_API


def _issued(key: key_service.IssuedKey) -> IssuedKeyOut:
    return IssuedKeyOut(
        key=key.key, prefix=key.prefix, tenant_id=key.tenant_id, expires_at=key.expires_at
    )


def _expiry(seconds: int | None) -> datetime | None:
    return None if seconds is None else utcnow() + timedelta(seconds=seconds)


@router.post("/tenants", status_code=status.HTTP_201_CREATED)
def create_tenant(body: TenantCreate, session: SessionDep, _: AdminDep) -> TenantCreated:
    plan = TenantPlan(
        requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
        max_concurrency=body.max_concurrency,
        max_context_tokens=body.max_context_tokens,
    )
    created = operator.create_tenant(
        session,
        channel=API,
        name=body.name,
        plan=plan,
        synthetic=body.synthetic,
        canary_sample_rate=body.canary_sample_rate,
        key_name=body.key_name,
        key_expires_at=_expiry(body.key_expires_in_s),
    )
    session.flush()
    return TenantCreated(tenant=TenantOut.of(created.tenant), key=_issued(created.first_key))


@router.get("/tenants")
def list_tenants(session: SessionDep, _: AdminDep) -> list[TenantOut]:
    return [TenantOut.of(tenant) for tenant in tenant_service.list_tenants(session)]


@router.get("/tenants/{ref}")
def get_tenant(ref: str, session: SessionDep, _: AdminDep) -> TenantOut:
    return TenantOut.of(tenant_service.get_tenant(session, ref=ref))


@router.patch("/tenants/{ref}")
def update_tenant(ref: str, body: TenantUpdate, session: SessionDep, _: AdminDep) -> TenantOut:
    changes = body.model_dump(exclude_unset=True)
    limits = {name: changes[name] for name in tenant_service.LIMIT_FIELDS if name in changes}
    canary_changed = "canary_sample_rate" in changes or "synthetic" in changes
    tenant = operator.update_tenant(
        session,
        channel=API,
        ref=ref,
        status=body.status,
        limits=limits,
        canary=(body.canary_sample_rate, body.synthetic) if canary_changed else None,
    )
    session.flush()
    return TenantOut.of(tenant)


@router.post("/tenants/{ref}/keys", status_code=status.HTTP_201_CREATED)
def create_key(ref: str, body: KeyCreate, session: SessionDep, _: AdminDep) -> IssuedKeyOut:
    issued = operator.issue_key(
        session, channel=API, ref=ref, name=body.name, expires_at=_expiry(body.expires_in_s)
    )
    return _issued(issued)


@router.get("/tenants/{ref}/keys")
def list_keys(ref: str, session: SessionDep, _: AdminDep) -> list[KeyOut]:
    tenant = tenant_service.get_tenant(session, ref=ref)
    return [KeyOut.of(key) for key in key_service.list_keys(session, tenant_id=tenant.id)]


@router.post("/keys/{prefix}/revoke")
def revoke_key(prefix: str, session: SessionDep, _: AdminDep) -> KeyOut:
    return KeyOut.of(operator.revoke_key(session, channel=API, prefix=prefix))


@router.delete("/tenants/{ref}/responses")
def erase_responses(ref: str, session: SessionDep, _: AdminDep) -> ResponsesErasedOut:
    """Erase every stored response of the tenant (the Responses API's ``store``) now."""
    tenant, erased = operator.erase_responses(session, channel=API, ref=ref)
    return ResponsesErasedOut(tenant_id=tenant.id, erased=erased)


@router.get("/tenants/{ref}/usage")
def tenant_usage(
    ref: str,
    session: SessionDep,
    _: AdminDep,
    since: Instant | None = None,
    until: Instant | None = None,
) -> UsageOut:
    tenant = tenant_service.get_tenant(session, ref=ref)
    return usage_out(session, tenant_id=tenant.id, since=since, until=until)


@router.get("/engines")
def list_engines(state: StateDep, _: AdminDep) -> list[EngineOut]:
    return [engine_out(state.registry, record) for record in state.registry.records()]


@router.post("/engines", status_code=status.HTTP_201_CREATED)
async def register_engine(body: EngineIn, state: StateDep, _: AdminDep) -> EngineOut:
    spec = operator.engine_spec(body.model_dump())
    return _out(state, await operator.register_engine(state, channel=API, spec=spec))


@router.put("/engines/{name}/members")
async def set_members(name: str, body: MembersIn, state: StateDep, _: AdminDep) -> EngineOut:
    members = [m.model_dump(exclude_none=True) for m in body.members]
    return _out(state, await operator.set_members(state, channel=API, name=name, members=members))


@router.delete("/engines/{name}", status_code=status.HTTP_204_NO_CONTENT)
async def remove_engine(name: str, state: StateDep, _: AdminDep) -> None:
    await operator.remove_engine(state, channel=API, name=name)


@router.post("/engines/{name}/quarantine")
async def quarantine(name: str, body: QuarantineIn, state: StateDep, _: AdminDep) -> EngineOut:
    record = await operator.quarantine(state, channel=API, name=name, reason=body.reason)
    return _out(state, record)


@router.delete("/engines/{name}/quarantine")
async def clear_quarantine(
    name: str, state: StateDep, _: AdminDep, body: ClearQuarantineIn | None = None
) -> EngineOut:
    reason = None if body is None else body.reason
    record = await operator.clear_quarantine(state, channel=API, name=name, reason=reason)
    return _out(state, record)


@router.put("/engines/{name}/override")
async def set_override(name: str, body: OverrideIn, state: StateDep, _: AdminDep) -> EngineOut:
    record = await operator.set_override(
        state, channel=API, name=name, allow_unsafe=body.allow_unsafe
    )
    return _out(state, record)


def _out(state: GatewayState, record: EngineRecord) -> EngineOut:
    return engine_out(state.registry, record)
