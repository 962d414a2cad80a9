"""The gateway's lifecycles, each one enum with an explicit transition table and a TERMINAL set.

A tenant request moves::

    RECEIVED -> ROUTED -> ADMITTED -> FORWARDED -> STREAMING -> COMPLETED
        (any non-terminal phase) -> REJECTED | FAILED | CANCELLED
        FORWARDED | STREAMING -> CUT  (a response guard stopped the stream)

ROUTED: a model and candidate engines exist. ADMITTED: the request fits the real capacity and the
tenant's limits granted a lease. FORWARDED: the engine was called. The terminal phase is the
request's outcome in the audit row; the concurrency lease is released on the one transition into a
terminal phase, whatever the path (error, client disconnect, guard cut).

A tenant is ACTIVE or DISABLED (both reachable from each other; nothing is terminal: tenants are
never deleted, their audit rows outlive them).

Moves are checked by ``contracts.lifecycle.check_move``, the one transition mechanism every package
uses; a refused one raises its ``InvalidTransition``. Pure: no I/O, no framework imports.
"""

from __future__ import annotations

from enum import StrEnum

from contracts.lifecycle import InvalidTransition, check_move

__all__ = [
    "TENANT_TERMINAL",
    "TENANT_TRANSITIONS",
    "TERMINAL",
    "TRANSITIONS",
    "InvalidTransition",
    "Phase",
    "TenantStatus",
    "check_tenant_transition",
    "check_transition",
]


class Phase(StrEnum):
    RECEIVED = "received"
    ROUTED = "routed"
    ADMITTED = "admitted"
    FORWARDED = "forwarded"
    STREAMING = "streaming"
    COMPLETED = "completed"
    REJECTED = "rejected"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CUT = "cut"


TERMINAL: frozenset[Phase] = frozenset(
    {Phase.COMPLETED, Phase.REJECTED, Phase.FAILED, Phase.CANCELLED, Phase.CUT}
)

_ENDINGS = {Phase.REJECTED, Phase.FAILED, Phase.CANCELLED}

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.RECEIVED: frozenset({Phase.ROUTED, *_ENDINGS}),
    Phase.ROUTED: frozenset({Phase.ADMITTED, *_ENDINGS}),
    Phase.ADMITTED: frozenset({Phase.FORWARDED, *_ENDINGS}),
    Phase.FORWARDED: frozenset({Phase.STREAMING, Phase.COMPLETED, Phase.CUT, *_ENDINGS}),
    Phase.STREAMING: frozenset({Phase.COMPLETED, Phase.CUT, Phase.FAILED, Phase.CANCELLED}),
    **{phase: frozenset() for phase in TERMINAL},
}


def check_transition(current: Phase, target: Phase) -> Phase:
    """``target``, or ``InvalidTransition`` (a bug in the gateway, never a client error)."""
    check_move(TRANSITIONS, "request phase", "", current, target)
    return target


class TenantStatus(StrEnum):
    ACTIVE = "active"
    DISABLED = "disabled"


TENANT_TRANSITIONS: dict[TenantStatus, frozenset[TenantStatus]] = {
    TenantStatus.ACTIVE: frozenset({TenantStatus.DISABLED}),
    TenantStatus.DISABLED: frozenset({TenantStatus.ACTIVE}),
}
TENANT_TERMINAL: frozenset[TenantStatus] = frozenset()


def check_tenant_transition(current: TenantStatus, target: TenantStatus) -> TenantStatus:
    if current is target:
        return target  # idempotent: disabling a disabled tenant changes nothing
    check_move(TENANT_TRANSITIONS, "tenant status", "", current, target)
    return target
