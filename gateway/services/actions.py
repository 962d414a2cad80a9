"""The operators' own audit: one ``admin_actions`` row per change an operator makes.

Written by ``gateway.services.operator`` in the same unit of work as the change itself, whichever
channel it came through (the admin API or the console), so a change and its record commit
together or not at all. A row holds the action, its target (a tenant id, a key prefix, an engine
name), the channel and, where the action asks for one, the operator's reason: never a key, a token
or a member's credential.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from enum import StrEnum

from sqlalchemy import String, select
from sqlalchemy.orm import Session

from contracts.sql import utcnow
from gateway.db.models import AdminAction
from gateway.db.text import storable


def _length(column: str) -> int | None:
    column_type = AdminAction.__table__.c[column].type
    return column_type.length if isinstance(column_type, String) else None


class Channel(StrEnum):
    ADMIN_API = "admin_api"
    CONSOLE = "console"


class ActionKind(StrEnum):
    TENANT_CREATE = "tenant.create"
    TENANT_UPDATE = "tenant.update"
    TENANT_ERASE_RESPONSES = "tenant.erase_responses"
    KEY_ISSUE = "key.issue"
    KEY_REVOKE = "key.revoke"
    ENGINE_REGISTER = "engine.register"
    ENGINE_REMOVE = "engine.remove"
    ENGINE_MEMBERS = "engine.members"
    ENGINE_QUARANTINE = "engine.quarantine"
    ENGINE_CLEAR = "engine.clear_quarantine"
    ENGINE_OVERRIDE = "engine.override"


def record(
    session: Session,
    *,
    channel: Channel,
    action: ActionKind,
    target: str,
    detail: str | None = None,
    reason: str | None = None,
) -> AdminAction:
    row = AdminAction(
        at=utcnow(),
        channel=channel.value,
        action=action.value,
        target=storable(target, _length("target")),
        detail=None if detail is None else storable(detail, _length("detail")),
        reason=None if reason is None else storable(reason, _length("reason")),
    )
    session.add(row)
    return row


def recent(
    session: Session, *, limit: int = 50, targets: Collection[str] | None = None
) -> Sequence[AdminAction]:
    """The latest actions first (on one of ``targets`` when given)."""
    query = select(AdminAction)
    if targets is not None:
        query = query.where(AdminAction.target.in_(list(targets)))
    return session.scalars(query.order_by(AdminAction.id.desc()).limit(limit)).all()
