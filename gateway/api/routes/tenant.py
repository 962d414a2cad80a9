"""What a tenant may see about itself: its own usage (never another tenant's)."""

from __future__ import annotations

from fastapi import APIRouter

from contracts.sql import run_in_session
from gateway.api.schemas_admin import UsageOut
from gateway.api.timestamps import Instant
from gateway.api.usage import usage_out
from gateway.deps import CurrentTenant, StateDep

router = APIRouter(prefix="/v1", tags=["tenant"])


@router.get("/usage")
async def own_usage(
    principal: CurrentTenant,
    state: StateDep,
    since: Instant | None = None,
    until: Instant | None = None,
) -> UsageOut:
    tenant_id = principal.tenant_id  # the key decides the tenant; no parameter can widen it
    return await run_in_session(
        state.sessions,
        lambda session: usage_out(session, tenant_id=tenant_id, since=since, until=until),
    )
