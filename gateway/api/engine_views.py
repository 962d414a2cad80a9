"""How an engine record is shown (admin API, health): state and capacity truth, no secrets."""

from __future__ import annotations

from gateway.api.schemas_admin import EngineOut, IsolationOut, MemberOut, RoleOut
from gateway.engines.capacity import CapacitySnapshot
from gateway.engines.registry import EngineRecord, EngineRegistry, model_of
from gateway.engines.spec import EngineKind


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
        blocked_detail=registry.detail(record),
        last_error=record.last_error,
        capacity_age_s=None if age is None else round(age, 3),
        measured=None if snapshot is None else snapshot.measured,
        context_window=None if snapshot is None else snapshot.context_window,
        real_pool_tokens=None if snapshot is None else snapshot.real_pool,
        max_request_tokens=None if snapshot is None else snapshot.max_request_tokens,
        drift=None if snapshot is None else snapshot.drift,
        faults=[] if snapshot is None else list(snapshot.faults),
        roles=[
            RoleOut(
                role=role.role,
                pool_tokens=role.pool_tokens,
                max_request_tokens=role.max_request_tokens,
                free_tokens=role.free_tokens,
                page_size=role.page_size,
                pool_declared=role.pool_declared,
                unknown_reason=role.unknown_reason,
            )
            for role in (snapshot.roles if snapshot is not None else ())
        ],
        members=[MemberOut(name=m.name, role=m.role.value, url=m.url) for m in record.spec.members],
        prefix_cache_isolation=isolation_out(record.spec.kind, snapshot),
        version=None if snapshot is None else snapshot.version,
        tokenize_url=None
        if snapshot is None or snapshot.tokenize is None
        else snapshot.tokenize.url,
        holds_key=record.spec.api_key is not None or record.spec.api_key_env is not None,
        sends_kvguard_headers=record.spec.sends_kvguard_headers,
        quarantine_reason=record.controls.quarantine_reason,
        allow_unsafe=record.controls.allow_unsafe,
        in_flight=record.in_flight,
    )


def isolation_out(kind: EngineKind, snapshot: CapacitySnapshot | None) -> IsolationOut:
    """Prefix-cache isolation as this engine kind and version allow it."""
    if kind is EngineKind.BUNDLED:
        return IsolationOut(
            supported=True,
            field=None,
            detail=(
                "bundled engine: KV pages are never shared across tenants unless an operator"
                " groups them (KVGUARD_PREFIX_CACHE_GROUPS)"
            ),
        )
    if kind in (EngineKind.OPENAI, EngineKind.LITELLM):
        return IsolationOut(
            supported=False, field=None, detail=f"{kind.value}: no per-request cache isolation"
        )
    if snapshot is None or snapshot.isolation is None:
        return IsolationOut(supported=False, field=None, detail="not introspected yet")
    field = snapshot.isolation.field
    return IsolationOut(supported=field is not None, field=field, detail=snapshot.isolation.detail)
