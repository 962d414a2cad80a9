"""SQLAlchemy 2 tables of the gateway: tenants, API keys, request audit, registered engines, engine
controls, the responses tenants asked the gateway to keep (the Responses API's ``store``), console
sessions and admin actions.

Tables only (the HTTP schemas live in ``gateway.api.schemas``). Every change here needs an Alembic
revision in ``migrations/versions`` (one logical change each); a test compares this metadata with
the migrated schema so the two cannot drift apart.

Audit rows hold metadata only: counts, ids, outcomes and timings, never prompt or completion text.
Stored responses are the one table with content, kept only because the tenant asked (``store``),
keyed by (tenant, id) and deleted with their tenant.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from contracts.sql import AUDIT_ID, Base, UTCDateTime, utcnow

INTEGER_MAX = 2**31 - 1
"""The largest value an ``Integer`` column holds on every backend (PostgreSQL's int4): the admin
API and CLI refuse larger limits and declared sizes (a 400 naming the field, not a 500)."""


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    status: Mapped[str] = mapped_column(String(16))
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    max_context_tokens: Mapped[int | None] = mapped_column(Integer)
    canary_sample_rate: Mapped[float] = mapped_column(Float, default=0.0)
    synthetic: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    def __repr__(self) -> str:
        return f"Tenant(id={self.id!r}, name={self.name!r}, status={self.status!r})"


class ApiKey(Base):
    """A tenant key: the prefix finds the row, the SHA-256 of the secret proves possession."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    def __repr__(self) -> str:  # the hash stays out of logs
        return f"ApiKey(prefix={self.prefix!r}, tenant_id={self.tenant_id!r})"


class RequestAudit(Base):
    """One row per authenticated request: metadata only, never text."""

    __tablename__ = "request_audit"
    __table_args__ = (Index("ix_request_audit_tenant_started", "tenant_id", "started_at"),)

    id: Mapped[int] = mapped_column(AUDIT_ID, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(32), index=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_prefix: Mapped[str | None] = mapped_column(String(16))
    endpoint: Mapped[str] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(256))
    engine: Mapped[str | None] = mapped_column(String(64))
    stream: Mapped[bool] = mapped_column(Boolean)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(16))
    http_status: Mapped[int] = mapped_column(Integer)
    error_code: Mapped[str | None] = mapped_column(String(64))
    handoff_outcome: Mapped[str | None] = mapped_column(String(32))
    reserved_tokens: Mapped[int | None] = mapped_column(Integer)
    transferred_tokens: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    duration_ms: Mapped[float] = mapped_column(Float)


class RegisteredEngine(Base):
    """An engine added through the admin API (configured engines live in settings)."""

    __tablename__ = "engines"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    base_url: Mapped[str] = mapped_column(String(512))
    model: Mapped[str | None] = mapped_column(String(256))
    litellm_model: Mapped[str | None] = mapped_column(String(256))
    declared_max_model_len: Mapped[int | None] = mapped_column(Integer)
    allow_unverified: Mapped[bool] = mapped_column(Boolean, default=False)
    upstream: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    members: Mapped[str | None] = mapped_column(Text)  # JSON list of MemberSpec
    api_key_env: Mapped[str | None] = mapped_column(String(128))  # a reference, never the key
    declared_pool_tokens: Mapped[int | None] = mapped_column(Integer)
    send_kvguard_headers: Mapped[bool | None] = mapped_column(Boolean)
    api_base: Mapped[bool | None] = mapped_column(Boolean)
    discover_members: Mapped[bool | None] = mapped_column(Boolean)


class EngineControl(Base):
    """Admin decisions about any engine by name: quarantine, and routing despite unsafe state."""

    __tablename__ = "engine_controls"

    engine_name: Mapped[str] = mapped_column(String(64), primary_key=True)
    quarantined_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    quarantine_reason: Mapped[str | None] = mapped_column(String(256))
    quarantine_cleared_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    allow_unsafe: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class StoredResponse(Base):
    """A response a tenant asked the gateway to keep (``store``), with the conversation before it.

    The primary key leads with the tenant: a lookup is always by (tenant, id), and another tenant's
    id finds nothing under this tenant's part of the index, exactly like an id that never existed
    (``gateway.services.responses``). ``conversation`` is every input item of the chain up to and
    including this turn's (this turn's from ``input_start``), so a response is whole on its own:
    continuing it never depends on an earlier one that has since been deleted or expired.
    """

    __tablename__ = "stored_responses"
    __table_args__ = (Index("ix_stored_responses_expires_at", "expires_at"),)

    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    status: Mapped[str] = mapped_column(String(16))
    response: Mapped[dict[str, Any]] = mapped_column(JSON)  # the Response the client got
    conversation: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    input_start: Mapped[int] = mapped_column(Integer)

    def __repr__(self) -> str:  # content stays out of logs
        return f"StoredResponse(tenant_id={self.tenant_id!r}, id={self.id!r})"


class ConsoleSession(Base):
    """A signed-in operator console session (``gateway.console.sessions``): the SHA-256 of the
    cookie's token finds the row; ``binding`` ties it to the admin token it was opened with."""

    __tablename__ = "console_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    binding: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)

    def __repr__(self) -> str:  # the hash stays out of logs
        return f"ConsoleSession(expires_at={self.expires_at!r})"


class AdminAction(Base):
    """One operator action (``gateway.services.actions``): what, on what, through which channel,
    what changed, and the operator's reason where one is asked for. Ids, names and numbers only."""

    __tablename__ = "admin_actions"
    __table_args__ = (Index("ix_admin_actions_at", "at"),)

    id: Mapped[int] = mapped_column(AUDIT_ID, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    channel: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(128))
    detail: Mapped[str | None] = mapped_column(String(256))
    reason: Mapped[str | None] = mapped_column(String(256))
