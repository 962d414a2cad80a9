"""Admin and tenant-facing API shapes (HTTP edge). Secrets appear only in ``IssuedKeyOut``."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.db.models import INTEGER_MAX, ApiKey, Tenant
from gateway.db.text import StoredText
from gateway.engines.spec import EngineKind, MemberRole, UpstreamPath
from gateway.lifecycle import TenantStatus

ColumnInt = Annotated[int, Field(gt=0, le=INTEGER_MAX)]  # what an Integer column holds
PositiveLimit = ColumnInt | None
# now + the lifetime must stay a datetime (year <= 9999): unbounded, it was an OverflowError (500)
MAX_KEY_LIFETIME_S = 100 * 365 * 24 * 3600
KeyLifetime = Annotated[int, Field(gt=0, le=MAX_KEY_LIFETIME_S)] | None
TenantName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$")]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LimitsIn(_Closed):
    requests_per_minute: PositiveLimit = None
    tokens_per_minute: PositiveLimit = None
    max_concurrency: PositiveLimit = None
    max_context_tokens: PositiveLimit = None


class TenantCreate(LimitsIn):
    name: TenantName
    canary_sample_rate: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    synthetic: bool = False
    key_name: StoredText | None = Field(default=None, max_length=64)
    key_expires_in_s: KeyLifetime = None


class TenantUpdate(_Closed):
    """Only the fields present change; a limit set to null removes that limit."""

    status: Annotated[TenantStatus | None, Field(strict=False)] = None
    requests_per_minute: PositiveLimit = None
    tokens_per_minute: PositiveLimit = None
    max_concurrency: PositiveLimit = None
    max_context_tokens: PositiveLimit = None
    canary_sample_rate: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    synthetic: bool | None = None


class KeyCreate(_Closed):
    name: StoredText | None = Field(default=None, max_length=64)
    expires_in_s: KeyLifetime = None


class TenantOut(BaseModel):
    id: str
    name: str
    status: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrency: int | None
    max_context_tokens: int | None
    canary_sample_rate: float
    synthetic: bool
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, tenant: Tenant) -> TenantOut:
        return cls.model_validate(tenant, from_attributes=True)


class KeyOut(BaseModel):
    prefix: str
    tenant_id: str
    name: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None

    @classmethod
    def of(cls, key: ApiKey) -> KeyOut:
        return cls.model_validate(key, from_attributes=True)


class IssuedKeyOut(BaseModel):
    """The only response that ever contains a full key: store it now, it is not shown again."""

    key: str
    prefix: str
    tenant_id: str
    expires_at: datetime | None


class TenantCreated(BaseModel):
    tenant: TenantOut
    key: IssuedKeyOut


class ResponsesErasedOut(BaseModel):
    tenant_id: str
    erased: int  # stored responses deleted


class OutcomeUsageOut(BaseModel):
    outcome: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


class UsageOut(BaseModel):
    tenant_id: str
    since: datetime | None
    until: datetime | None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    by_outcome: list[OutcomeUsageOut]


class MemberIn(_Closed):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    role: Annotated[MemberRole, Field(strict=False)]
    url: StoredText = Field(min_length=1, max_length=512)
    api_key_env: str | None = Field(default=None, max_length=128)
    declared_pool_tokens: ColumnInt | None = None


class EngineIn(_Closed):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    kind: Annotated[EngineKind, Field(strict=False)]  # enums arrive as JSON strings
    base_url: StoredText = Field(min_length=1, max_length=512)
    model: StoredText | None = Field(default=None, max_length=256)
    litellm_model: StoredText | None = Field(default=None, max_length=256)
    declared_max_model_len: ColumnInt | None = None
    allow_unverified: bool = False
    upstream: Annotated[UpstreamPath | None, Field(strict=False)] = None
    members: list[MemberIn] = Field(default_factory=list, max_length=256)
    api_key_env: str | None = Field(
        default=None,
        max_length=128,
        description="the gateway environment variable that holds the engine's key (a secret "
        "reference: the key itself is never sent to, stored by or returned from this API)",
    )
    declared_pool_tokens: ColumnInt | None = None
    send_kvguard_headers: bool | None = None
    api_base: bool = True
    discover_members: bool = False


class QuarantineIn(_Closed):
    reason: StoredText = Field(min_length=1, max_length=256)


class ClearQuarantineIn(_Closed):
    """Why the quarantine may be lifted (recorded in the admin actions)."""

    reason: StoredText | None = Field(default=None, min_length=1, max_length=256)


class MembersIn(_Closed):
    """The whole new member list of an admin-registered engine group."""

    members: list[MemberIn] = Field(max_length=256)


class OverrideIn(_Closed):
    allow_unsafe: bool


class RoleOut(BaseModel):
    role: str
    pool_tokens: int | None
    max_request_tokens: int | None
    free_tokens: int | None
    page_size: int | None
    pool_declared: bool = False
    unknown_reason: str | None = None


class IsolationOut(BaseModel):
    """Can this engine keep tenants' prefix caches apart (the gateway sets the field per tenant)?"""

    supported: bool
    field: str | None
    detail: str


class MemberOut(BaseModel):
    name: str
    role: str
    url: str


class EngineOut(BaseModel):
    name: str
    kind: str
    base_url: str
    source: Literal["config", "admin"]
    model: str | None
    routable: bool
    blocked_reason: str | None
    blocked_detail: str | None
    last_error: str | None
    capacity_age_s: float | None
    measured: bool | None
    context_window: int | None
    real_pool_tokens: int | None
    max_request_tokens: int | None
    drift: str | None
    faults: list[str]
    roles: list[RoleOut]
    members: list[MemberOut]
    prefix_cache_isolation: IsolationOut
    version: str | None
    tokenize_url: str | None
    holds_key: bool
    sends_kvguard_headers: bool
    quarantine_reason: str | None
    allow_unsafe: bool
    in_flight: int
