"""What the canary finds, named once: the kind of a finding, the evidence behind it, its severity
and what was done about it. Pure (the scanner and the findings table share these).

- ``FindingKind``: ``cross_tenant`` / ``cross_request`` (a marker of another tenant or another
  request in an answer: the scanner finds these), ``replay`` (such a marker that stands in the
  request itself, in a form ``canary.evidence`` detects: the tenant sent it in, the engine only
  wrote it back), ``usage_mismatch`` / ``fast_first_token`` (counts and timings that do not add
  up: the runtime's lower-severity checks).
- ``Evidence``: how the finding is known -- ``confirmed`` (a complete marker whose MAC verifies),
  ``suspected`` (a damaged copy carrying a known foreign tenant's tag), ``measured`` (counts or
  timings, no marker).
- ``FindingSeverity``: how bad it is, which follows from the evidence (``severity_of``): critical,
  high, low; a replay is high whatever its evidence (it proves no leak by the engine, but a
  tenant holding another's marker is worth an operator's look).
- ``Action``: what the gateway did (cut and quarantined, cut, recorded).
"""

from __future__ import annotations

from enum import StrEnum


class FindingKind(StrEnum):
    CROSS_TENANT = "cross_tenant"
    CROSS_REQUEST = "cross_request"
    REPLAY = "replay"
    USAGE_MISMATCH = "usage_mismatch"
    FAST_FIRST_TOKEN = "fast_first_token"


class FindingSeverity(StrEnum):
    CRITICAL = "critical"
    HIGH = "high"
    LOW = "low"


class Evidence(StrEnum):
    CONFIRMED = "confirmed"  # a complete marker whose MAC verifies
    SUSPECTED = "suspected"  # a damaged marker carrying a known foreign tenant's tag
    MEASURED = "measured"  # counts or timings, no marker


class Action(StrEnum):
    CUT_AND_QUARANTINED = "cut_quarantined"
    CUT = "cut"
    RECORDED = "recorded"


_SEVERITY = {
    Evidence.CONFIRMED: FindingSeverity.CRITICAL,
    Evidence.SUSPECTED: FindingSeverity.HIGH,
    Evidence.MEASURED: FindingSeverity.LOW,
}


def severity_of(evidence: Evidence, kind: FindingKind | None = None) -> FindingSeverity:
    if kind is FindingKind.REPLAY:
        return FindingSeverity.HIGH
    return _SEVERITY[evidence]
