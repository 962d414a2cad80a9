"""Typed messages of the engine's HTTP contract that other deployables rely on.

The gateway reaches the engine only through these shapes (and the OpenAI-compatible routes), never
by importing engine internals:

- the request headers naming the tenant and the request;
- ``GET /engine/capacity``: ``CapacityReport`` (with a ``RoleCapacity`` per role on the path);
- the ``kvguard`` extension of every answer (a whole response, and each choice's finish chunk and
  the error body of a stream): ``{"role": ..., "handoff": null | HandoffProof}``, the proof of the
  KV the answer was computed from (null on a unified role).

Changing a field of the capacity report is a protocol change: bump ``CAPACITY_SCHEMA_VERSION`` and
keep the gateway's adapter in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# 2: the report names the OpenAI request features the path serves (``features``)
CAPACITY_SCHEMA_VERSION = 2
# Features an engine may report: grammar-constrained ``response_format`` (json_object,
# json_schema) and tool calls (``tools``, ``tool_choice``, tool messages, assistant tool_calls).
STRUCTURED_OUTPUT = "structured_output"
TOOLS = "tools"
STRUCTURED_FEATURES = frozenset({STRUCTURED_OUTPUT, TOOLS})
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


class CapacityReport(RoleCapacity):
    """`GET /engine/capacity`: the truth the gateway enforces.

    The entry role's own ``RoleCapacity``, widened to the serving path it is the entry point of:
    ``max_request_tokens``, ``drift`` and ``faults`` are the path's (every role's), and ``roles``
    lists every role on the path (decode reports prefill too).
    """

    schema_version: int = CAPACITY_SCHEMA_VERSION
    model: str
    protocol_version: int  # the entry role's handoff protocol (always known here)
    max_request_tokens: int = Field(
        ge=0, description="largest prompt + max_tokens the serving path can accept end to end"
    )
    zero_on_free: bool
    tokenizer: str | None = Field(
        default=None,
        description="an id of tokenizer + chat template a client may apply itself to count "
        "prompt tokens exactly (the bundled byte tokenizer's); null: ask /tokenize",
    )
    features: list[str] = Field(
        default_factory=list,
        description="OpenAI request features the whole path serves beyond plain chat and "
        "completions: 'structured_output' (response_format json_object/json_schema), 'tools' "
        "(tools, tool_choice, tool messages); a gateway forwards those fields only when named",
    )
    drift: str | None = Field(
        default=None, description="null, or why the advertised window exceeds a real pool"
    )
    faults: list[str] = Field(default_factory=list, description="enabled fault drills, any role")
    roles: list[RoleCapacity] = Field(
        default_factory=list, description="every role on the path (decode reports prefill too)"
    )
    unavailable: str | None = Field(
        default=None,
        description="null, or why the path cannot serve now (e.g. prefill unknown or stale)",
    )


# -- the proof an answer carries ------------------------------------------------------------------

HANDOFF_OK = "ok"
EXTENSION = "kvguard"


@dataclass(frozen=True, slots=True)
class HandoffProof:
    """What decode can prove about the KV an answer was computed from (the gateway audits it, and
    refuses an answer whose proof does not hold).

    ``outcome`` is prefill's explicit outcome, or ``lost`` / ``timeout`` / ``aborted`` when no
    result arrived. ``transferred_tokens`` is None when prefill reported no range.
    ``protocol_version`` is None only when read from an engine that did not say.
    """

    protocol_version: int | None
    outcome: str
    reserved_tokens: int
    transferred_tokens: int | None
    accepted: bool = True
    checks: tuple[str, ...] = ()
    skipped_checks: tuple[str, ...] = ()
    failed_check: str | None = None
    transfer_ms: float | None = None
    checksum_ms: float | None = None

    @property
    def consistent(self) -> bool:
        """Positive evidence only: outcome ok, accepted, no failed check, and every reserved token
        transferred."""
        return (
            self.outcome.lower() == HANDOFF_OK
            and self.accepted
            and self.failed_check is None
            and self.transferred_tokens == self.reserved_tokens
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "protocol_version": self.protocol_version,
            "outcome": self.outcome,
            "reserved_tokens": self.reserved_tokens,
            "transferred_tokens": self.transferred_tokens,
            "accepted": self.accepted,
            "checks": list(self.checks),
            "skipped_checks": list(self.skipped_checks),
            "failed_check": self.failed_check,
            "transfer_ms": self.transfer_ms,
            "checksum_ms": self.checksum_ms,
        }

    @classmethod
    def from_wire(cls, raw: object) -> HandoffProof | None:
        """The proof as ``as_dict`` wrote it; None when it is not one (no outcome or reserved
        count). A missing ``accepted`` reads as accepted: the counts still have to match."""
        if not isinstance(raw, dict):
            return None
        reserved = _int_or_none(raw.get("reserved_tokens"))
        transferred, outcome = raw.get("transferred_tokens"), raw.get("outcome")
        if reserved is None or not isinstance(outcome, str):
            return None
        if transferred is not None and _int_or_none(transferred) is None:
            return None
        return cls(
            protocol_version=_int_or_none(raw.get("protocol_version")),
            outcome=outcome,
            reserved_tokens=reserved,
            transferred_tokens=transferred,
            accepted=raw.get("accepted") is not False,
            checks=_strings(raw.get("checks")),
            skipped_checks=_strings(raw.get("skipped_checks")),
            failed_check=_str_or_none(raw.get("failed_check")),
            transfer_ms=_float_or_none(raw.get("transfer_ms")),
            checksum_ms=_float_or_none(raw.get("checksum_ms")),
        )


def handoff_of(answer: dict[str, Any]) -> HandoffProof | None:
    """The proof in an answer or a chunk: its ``kvguard.handoff`` (or a top-level ``handoff``)."""
    raw = answer.get("handoff")
    extension = answer.get(EXTENSION)
    if raw is None and isinstance(extension, dict):
        raw = extension.get("handoff")
    return HandoffProof.from_wire(raw)


def answer_extension(role: str, proof: HandoffProof | None) -> dict[str, Any]:
    """The ``kvguard`` extension an engine adds to an answer."""
    return {EXTENSION: {"role": role, "handoff": None if proof is None else proof.as_dict()}}


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _strings(value: object) -> tuple[str, ...]:
    return tuple(str(item) for item in value) if isinstance(value, list) else ()
