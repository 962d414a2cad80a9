"""How an engine record is shown (admin API, health): state and capacity truth, no secrets."""

from __future__ import annotations

from gateway.api.schemas_admin import EngineOut, RoleOut
from gateway.engines.registry import EngineRecord, EngineRegistry, model_of


def engine_out(registry: EngineRegistry, record: EngineRecord) -> EngineOut:
    block = registry.block(record)
    snapshot = record.snapshot
    age = registry.capacity_age_s(record)
    return EngineOut(
        name=record.name,
        kind=record.spec.kind.value,
        base_url=record.spec.base_url,
        source=record.source.value,
        model=model_of(record),
        routable=block is None,
        blocked_reason=None if block is None else block.value,
        last_error=record.last_error,
        capacity_age_s=None if age is None else round(age, 3),
        measured=None if snapshot is None else snapshot.measured,
        context_window=None if snapshot is None else snapshot.context_window,
        real_pool_tokens=None if snapshot is None else snapshot.real_pool,
        enforceable_limit=None if snapshot is None else snapshot.enforceable_limit,
        drift=None if snapshot is None else snapshot.drift,
        faults=[] if snapshot is None else list(snapshot.faults),
        roles=[
            RoleOut(
                role=role.role,
                pool_tokens=role.pool_tokens,
                max_request_tokens=role.max_request_tokens,
                free_tokens=role.free_tokens,
                page_size=role.page_size,
            )
            for role in (snapshot.roles if snapshot is not None else ())
        ],
        quarantine_reason=record.controls.quarantine_reason,
        allow_unsafe=record.controls.allow_unsafe,
        in_flight=record.in_flight,
    )
