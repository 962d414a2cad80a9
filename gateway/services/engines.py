"""Engines registered through the admin API (or the console), and admin controls (quarantine,
allow-unsafe).

Both live in SQL so every replica converges on them (the poller reloads them each cycle); the
admin route also applies a change to its own replica's registry at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import SecretStr, TypeAdapter, ValidationError
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from contracts.sql import run_in_session, utcnow
from gateway.config import (
    EngineKind,
    EngineSpec,
    MemberSpec,
    UpstreamPath,
    with_engine_credential,
)
from gateway.db.models import EngineControl, RegisteredEngine
from gateway.engines.registry import EngineControls, EngineRegistry, EngineSource
from gateway.errors import Conflict, InvalidRequest, NotFound


def register_engine(session: Session, *, spec: EngineSpec, taken: set[str]) -> RegisteredEngine:
    if spec.name in taken or session.get(RegisteredEngine, spec.name) is not None:
        raise Conflict(f"an engine named '{spec.name}' already exists", code="engine_exists")
    row = RegisteredEngine(
        name=spec.name,
        kind=spec.kind.value,
        base_url=spec.base_url,
        model=spec.model,
        litellm_model=spec.litellm_model,
        declared_max_model_len=spec.declared_max_model_len,
        allow_unverified=spec.allow_unverified,
        upstream=spec.upstream.value if spec.upstream else None,
        members=_members_json(spec.members),
        api_key_env=spec.api_key_env,
        declared_pool_tokens=spec.declared_pool_tokens,
        send_kvguard_headers=spec.send_kvguard_headers,
        api_base=spec.api_base,
        discover_members=spec.discover_members,
    )
    session.add(row)
    return row


def _members_json(members: tuple[MemberSpec, ...]) -> str | None:
    return json.dumps([m.model_dump(exclude_none=True) for m in members]) if members else None


def set_members(session: Session, *, name: str, members: Sequence[Mapping[str, Any]]) -> EngineSpec:
    """Replace the members of an admin-registered engine; the whole spec is validated again (a
    group kind, discovery and declared pools must still agree)."""
    row = session.get(RegisteredEngine, name)
    if row is None:
        raise NotFound(
            f"no admin-registered engine '{name}' (configured engines change in settings)",
            code="engine_not_found",
        )
    try:
        spec = EngineSpec.model_validate({**_spec_of(row).model_dump(), "members": members})
    except ValidationError as exc:
        raise InvalidRequest(f"invalid members: {exc.errors()[0]['msg']}", param="members") from exc
    row.members = _members_json(spec.members)
    return spec


def remove_engine(session: Session, *, name: str) -> None:
    row = session.get(RegisteredEngine, name)
    if row is None:
        raise NotFound(f"no admin-registered engine '{name}'", code="engine_not_found")
    session.delete(row)


def registered_specs(session: Session) -> list[EngineSpec]:
    rows = session.scalars(select(RegisteredEngine).order_by(RegisteredEngine.name))
    return [_spec_of(row) for row in rows]


def _spec_of(row: RegisteredEngine) -> EngineSpec:
    return EngineSpec(
        name=row.name,
        kind=EngineKind(row.kind),
        base_url=row.base_url,
        model=row.model,
        litellm_model=row.litellm_model,
        declared_max_model_len=row.declared_max_model_len,
        allow_unverified=row.allow_unverified,
        upstream=UpstreamPath(row.upstream) if row.upstream else None,
        members=_MEMBERS.validate_json(row.members) if row.members else (),
        api_key_env=row.api_key_env,
        declared_pool_tokens=row.declared_pool_tokens,
        send_kvguard_headers=row.send_kvguard_headers,
        api_base=True if row.api_base is None else row.api_base,
        discover_members=bool(row.discover_members),
    )


_MEMBERS = TypeAdapter(tuple[MemberSpec, ...])


def controls(session: Session) -> dict[str, EngineControls]:
    return {
        row.engine_name: EngineControls(
            quarantine_reason=row.quarantine_reason if row.quarantined_at else None,
            allow_unsafe=row.allow_unsafe,
        )
        for row in session.scalars(select(EngineControl))
    }


def _control(session: Session, name: str) -> EngineControl:
    """The engine's control row, created when missing, locked for this unit of work.

    Two writers may reach a new engine's row at once (the quarantine writer behind a slow
    database and an admin's clear): the insert does nothing when the other got there first, and
    waits for it while it is uncommitted, so neither fails on the primary key."""
    values = {"engine_name": name, "allow_unsafe": False, "updated_at": utcnow()}
    if session.get_bind().dialect.name == "postgresql":
        pg_absent = postgresql_insert(EngineControl).values(values)
        session.execute(pg_absent.on_conflict_do_nothing(index_elements=["engine_name"]))
    else:
        absent = sqlite_insert(EngineControl).values(values)
        session.execute(absent.on_conflict_do_nothing(index_elements=["engine_name"]))
    row = session.get(EngineControl, name, with_for_update=True, populate_existing=True)
    assert row is not None  # inserted above or by the writer it waited for
    return row


def quarantine(
    session: Session, *, name: str, reason: str, at: datetime | None = None
) -> EngineControls:
    """Record a quarantine decided ``at`` (default now); one decided before the last clear (a
    spooled decision written late, lifted by an admin since) changes nothing."""
    row = _control(session, name)
    at = at or utcnow()
    if row.quarantine_cleared_at is not None and row.quarantine_cleared_at > at:
        reason_now = row.quarantine_reason if row.quarantined_at else None
        return EngineControls(quarantine_reason=reason_now, allow_unsafe=row.allow_unsafe)
    row.quarantined_at, row.quarantine_reason, row.updated_at = at, reason, utcnow()
    return EngineControls(quarantine_reason=reason, allow_unsafe=row.allow_unsafe)


def clear_quarantine(session: Session, *, name: str) -> EngineControls:
    row = _control(session, name)
    now = utcnow()
    row.quarantined_at, row.quarantine_reason, row.updated_at = None, None, now
    row.quarantine_cleared_at = now
    return EngineControls(quarantine_reason=None, allow_unsafe=row.allow_unsafe)


def set_allow_unsafe(session: Session, *, name: str, allow: bool) -> EngineControls:
    row = _control(session, name)
    row.allow_unsafe, row.updated_at = allow, utcnow()
    reason = row.quarantine_reason if row.quarantined_at else None
    return EngineControls(quarantine_reason=reason, allow_unsafe=allow)


async def reload_registry(
    *,
    registry: EngineRegistry,
    sessions: sessionmaker[Session],
    configured: list[EngineSpec],
    engine_token: SecretStr | None = None,
    quarantined: Mapping[str, str] | None = None,
) -> None:
    """Configured engines plus the admin-registered ones (presenting ``engine_token``, see
    ``with_engine_credential``), with every engine's controls; ``quarantined`` (engine ->
    reason: quarantines the database may not show yet) is merged in, never lifted."""

    def load(session: Session) -> tuple[list[EngineSpec], dict[str, EngineControls]]:
        return registered_specs(session), controls(session)

    registered, engine_controls = await run_in_session(sessions, load)
    names = {spec.name for spec in configured}
    members = [(spec, EngineSource.CONFIG) for spec in configured]
    members += [
        (with_engine_credential(spec, engine_token), EngineSource.ADMIN)
        for spec in registered
        if spec.name not in names
    ]
    for name, reason in (quarantined or {}).items():
        current = engine_controls.get(name, EngineControls())
        if current.quarantine_reason is None:
            engine_controls[name] = EngineControls(reason, current.allow_unsafe)
    registry.set_specs(members)
    registry.apply_controls(engine_controls)
