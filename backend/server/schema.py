"""Typed messages of the engine's HTTP contract that other deployables rely on.

The gateway reaches the engine only through these shapes (and the OpenAI-compatible routes), never
by importing engine internals. Changing a field here is a protocol change: bump
``CAPACITY_SCHEMA_VERSION`` and keep the gateway's adapter in step.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

CAPACITY_SCHEMA_VERSION = 1
TENANT_HEADER = "X-Kvguard-Tenant"
REQUEST_ID_HEADER = "X-Kvguard-Request-Id"


class Role(StrEnum):
    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"


class RoleCapacity(BaseModel):
    """What one role of the engine really has, read from the running process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    page_size: int = Field(gt=0, description="tokens per KV page")
    pool_pages: int = Field(ge=0, description="pages in the KV pool")
    pool_tokens: int = Field(ge=0, description="pool_pages * page_size")
    free_pages: int = Field(ge=0)
    quarantined_pages: int = Field(ge=0, default=0)
    context_window: int = Field(gt=0, description="the configured (advertised) window")
    max_request_tokens: int = Field(
        ge=0, description="largest prompt + max_tokens this role can ever accept"
    )
    protocol_version: int | None = Field(default=None, description="handoff protocol spoken")
    drift: str | None = Field(default=None, description="this role's own window/pool drift")
    faults: list[str] = Field(default_factory=list, description="this role's fault drills")
    age_s: float | None = Field(
        default=None, description="seconds since this role's report was read (peer roles only)"
    )


class CapacityReport(BaseModel):
    """`GET /engine/capacity`: the truth the gateway enforces."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = CAPACITY_SCHEMA_VERSION
    model: str
    role: Role
    protocol_version: int
    page_size: int = Field(gt=0)
    pool_pages: int = Field(ge=0)
    pool_tokens: int = Field(ge=0)
    free_pages: int = Field(ge=0)
    quarantined_pages: int = Field(ge=0, default=0)
    context_window: int = Field(gt=0)
    max_request_tokens: int = Field(
        ge=0, description="largest prompt + max_tokens the serving path can accept end to end"
    )
    zero_on_free: bool
    tokenizer: str | None = Field(
        default=None,
        description="an id of tokenizer + chat template a client may apply itself to count "
        "prompt tokens exactly (the bundled byte tokenizer's); null: ask /tokenize",
    )
    drift: str | None = Field(
        default=None, description="null, or why the advertised window exceeds the real pool"
    )
    faults: list[str] = Field(default_factory=list, description="enabled fault drills")
    roles: list[RoleCapacity] = Field(
        default_factory=list, description="every role on the path (decode reports prefill too)"
    )
    unavailable: str | None = Field(
        default=None,
        description="null, or why the path cannot serve now (e.g. prefill unknown or stale)",
    )
