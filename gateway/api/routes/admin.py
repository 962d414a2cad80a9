"""Admin API (``/admin``): tenants, keys, limits, usage, engines. Admin token only.

Plain ``def`` routes: FastAPI runs them in its threadpool, next to the synchronous DB session.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from fastapi import APIRouter, status
from pydantic import ValidationError

from contracts.sql import run_in_session, utcnow
from gateway.api.engine_views import engine_out
from gateway.api.schemas_admin import (
    EngineIn,
    EngineOut,
    IssuedKeyOut,
    KeyCreate,
    KeyOut,
    OverrideIn,
    QuarantineIn,
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
from gateway.engines.spec import EngineSpec
from gateway.errors import InvalidRequest, NotFound
from gateway.services import engines as engine_service
from gateway.services import keys as key_service
from gateway.services import tenants as tenant_service
from gateway.state import GatewayState

router = APIRouter(prefix="/admin", tags=["admin"])


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
    created = tenant_service.create_tenant(
        session,
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
    tenant = tenant_service.get_tenant(session, ref=ref)
    changes = body.model_dump(exclude_unset=True)
    if body.status is not None:
        tenant_service.set_status(session, tenant=tenant, status=body.status)
    limit_names = ("requests_per_minute", "tokens_per_minute", "max_concurrency")
    if any(name in changes for name in (*limit_names, "max_context_tokens")):
        current = tenant_service.plan_of(tenant)
        merged = {name: changes.get(name, getattr(current, name)) for name in current.__slots__}
        tenant_service.set_plan(session, tenant=tenant, plan=TenantPlan(**merged))
    if "canary_sample_rate" in changes or "synthetic" in changes:
        tenant_service.set_canary(
            session, tenant=tenant, sample_rate=body.canary_sample_rate, synthetic=body.synthetic
        )
    session.flush()
    return TenantOut.of(tenant)


@router.post("/tenants/{ref}/keys", status_code=status.HTTP_201_CREATED)
def create_key(ref: str, body: KeyCreate, session: SessionDep, _: AdminDep) -> IssuedKeyOut:
    tenant = tenant_service.get_tenant(session, ref=ref)
    issued = key_service.issue_key(
        session, tenant_id=tenant.id, name=body.name, expires_at=_expiry(body.expires_in_s)
    )
    return _issued(issued)


@router.get("/tenants/{ref}/keys")
def list_keys(ref: str, session: SessionDep, _: AdminDep) -> list[KeyOut]:
    tenant = tenant_service.get_tenant(session, ref=ref)
    return [KeyOut.of(key) for key in key_service.list_keys(session, tenant_id=tenant.id)]


@router.post("/keys/{prefix}/revoke")
def revoke_key(prefix: str, session: SessionDep, _: AdminDep) -> KeyOut:
    return KeyOut.of(key_service.revoke_key(session, prefix=prefix))


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
    try:
        spec = EngineSpec.model_validate(body.model_dump())
    except ValidationError as exc:
        raise InvalidRequest(f"invalid engine: {exc.errors()[0]['msg']}") from exc
    taken = {record.name for record in state.registry.records()}
    await run_in_session(
        state.sessions, lambda s: engine_service.register_engine(s, spec=spec, taken=taken)
    )
    await state.reload_engines()
    await state.poller.poll_once()
    record = state.registry.get(spec.name)
    assert record is not None
    return engine_out(state.registry, record)


@router.delete("/engines/{name}", status_code=status.HTTP_204_NO_CONTENT)
async def remove_engine(name: str, state: StateDep, _: AdminDep) -> None:
    await run_in_session(state.sessions, lambda s: engine_service.remove_engine(s, name=name))
    await state.reload_engines()


@router.post("/engines/{name}/quarantine")
async def quarantine(name: str, body: QuarantineIn, state: StateDep, _: AdminDep) -> EngineOut:
    _known(state, name)
    await state.quarantine(name, reason=body.reason)
    return engine_out(state.registry, _known(state, name))


@router.delete("/engines/{name}/quarantine")
async def clear_quarantine(name: str, state: StateDep, _: AdminDep) -> EngineOut:
    _known(state, name)
    await state.quarantines.clear(name)
    return engine_out(state.registry, _known(state, name))


@router.put("/engines/{name}/override")
async def set_override(name: str, body: OverrideIn, state: StateDep, _: AdminDep) -> EngineOut:
    _known(state, name)
    controls = await run_in_session(
        state.sessions,
        lambda s: engine_service.set_allow_unsafe(s, name=name, allow=body.allow_unsafe),
    )
    state.registry.set_controls(name, controls)
    return engine_out(state.registry, _known(state, name))


def _known(state: GatewayState, name: str) -> EngineRecord:
    record = state.registry.get(name)
    if record is None:
        raise NotFound(f"no engine '{name}'", code="engine_not_found")
    return record
