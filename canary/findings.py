"""Findings and probe runs in SQL (tables on the gateway's ``Base``; revisions 0007 and 0008).

Both are append-only records, written once and never updated: a finding is what the canary saw
and did at one moment (the engine's quarantine itself lives in ``engine_controls`` and is cleared
there by an admin). Rows hold ids, kinds, counts and times, never marker text or content.

Kinds and severities:

- ``cross_tenant`` / ``cross_request``: a marker of another tenant / another request in a
  response. ``critical`` with ``confirmed`` evidence (complete marker, MAC verified), ``high``
  with ``suspected`` evidence (a damaged copy carrying a known foreign tenant's tag).
- ``usage_mismatch``: the engine's ``usage.prompt_tokens`` disagrees with the gateway's own
  count (more prompt than was sent, or, on engines counted exactly, any difference). ``low``.
- ``fast_first_token``: the first token came back implausibly fast for the prompt's size on that
  engine, judged against the engine's own recent history. ``low``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Boolean, Float, Index, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from canary.kinds import Action, Evidence, FindingKind, FindingSeverity
from contracts.sql import AUDIT_ID, Base, UTCDateTime, utcnow


class ProbeKind(StrEnum):
    ECHO = "echo"
    CAPACITY = "capacity"
    CROSS_TENANT = "cross_tenant"
    ABORT = "abort"


class CanaryFinding(Base):
    __tablename__ = "canary_findings"
    __table_args__ = (
        Index("ix_canary_findings_victim_detected", "victim_tenant_id", "detected_at"),
        Index("ix_canary_findings_detected", "detected_at"),
    )

    id: Mapped[int] = mapped_column(AUDIT_ID, primary_key=True, autoincrement=True)
    detected_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    severity: Mapped[str] = mapped_column(String(16))
    evidence: Mapped[str] = mapped_column(String(16))
    victim_tenant_id: Mapped[str | None] = mapped_column(String(32))
    observer_tenant_id: Mapped[str | None] = mapped_column(String(32))
    engine: Mapped[str | None] = mapped_column(String(64))
    observer_request_id: Mapped[str | None] = mapped_column(String(32))
    victim_request_id: Mapped[str | None] = mapped_column(String(32))
    victim_engine: Mapped[str | None] = mapped_column(String(64))
    key_id: Mapped[int | None] = mapped_column(Integer)
    action: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str | None] = mapped_column(String(256))

    def __repr__(self) -> str:
        return f"CanaryFinding(id={self.id}, kind={self.kind!r}, severity={self.severity!r})"


class ProbeRun(Base):
    __tablename__ = "canary_probe_runs"
    __table_args__ = (Index("ix_canary_probe_runs_kind_started", "kind", "started_at"),)

    id: Mapped[int] = mapped_column(AUDIT_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(32), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    engine: Mapped[str | None] = mapped_column(String(64))
    expected: Mapped[str] = mapped_column(String(256))
    observed: Mapped[str] = mapped_column(String(256))
    passed: Mapped[bool] = mapped_column(Boolean)
    duration_ms: Mapped[float] = mapped_column(Float)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())


@dataclass(frozen=True, slots=True)
class NewFinding:
    """A finding to store: ids, kinds and numbers only."""

    kind: FindingKind
    severity: FindingSeverity
    evidence: Evidence
    action: Action
    observer_tenant_id: str | None
    engine: str | None
    observer_request_id: str | None
    victim_tenant_id: str | None = None
    victim_request_id: str | None = None
    victim_engine: str | None = None
    key_id: int | None = None
    detail: str | None = None
    detected_at: datetime | None = None  # None: when stored

    def to_record(self) -> dict[str, Any]:
        """As JSON-ready values (``canary.keeper`` spools findings before they are stored)."""
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("kind", "severity", "evidence", "action"):
            raw[name] = raw[name].value
        raw["detected_at"] = (self.detected_at or utcnow()).isoformat()
        return raw

    @classmethod
    def from_record(cls, raw: dict[str, Any]) -> NewFinding:
        return cls(
            **{
                **raw,
                "kind": FindingKind(raw["kind"]),
                "severity": FindingSeverity(raw["severity"]),
                "evidence": Evidence(raw["evidence"]),
                "action": Action(raw["action"]),
                "detected_at": datetime.fromisoformat(raw["detected_at"]),
            }
        )


@dataclass(frozen=True, slots=True)
class NewProbeRun:
    run_id: str
    kind: ProbeKind
    engine: str | None
    expected: str
    observed: str
    passed: bool
    duration_ms: float
    started_at: datetime


def store_finding(session: Session, finding: NewFinding) -> CanaryFinding:
    row = CanaryFinding(
        detected_at=finding.detected_at or utcnow(),
        kind=finding.kind.value,
        severity=finding.severity.value,
        evidence=finding.evidence.value,
        victim_tenant_id=finding.victim_tenant_id,
        observer_tenant_id=finding.observer_tenant_id,
        engine=finding.engine,
        observer_request_id=finding.observer_request_id,
        victim_request_id=finding.victim_request_id,
        victim_engine=finding.victim_engine,
        key_id=finding.key_id,
        action=finding.action.value,
        detail=None if finding.detail is None else finding.detail[:256],
    )
    session.add(row)
    session.flush()
    return row


def stored_already(session: Session, finding: NewFinding) -> bool:
    """Whether this finding (same request, kind and detection instant) is stored: a spooled one
    may be written again after a crash between the write and the spool's clean-up."""
    if finding.detected_at is None:
        return False
    query = select(CanaryFinding.id).where(
        CanaryFinding.observer_request_id == finding.observer_request_id,
        CanaryFinding.kind == finding.kind.value,
        CanaryFinding.detected_at == finding.detected_at,
    )
    return session.scalars(query.limit(1)).first() is not None


def list_findings(
    session: Session,
    *,
    victim_tenant_id: str | None = None,
    kind: str | None = None,
    severity: str | None = None,
    since: datetime | None = None,
    limit: int = 100,
) -> Sequence[CanaryFinding]:
    query = select(CanaryFinding)
    if victim_tenant_id is not None:
        query = query.where(CanaryFinding.victim_tenant_id == victim_tenant_id)
    if kind is not None:
        query = query.where(CanaryFinding.kind == kind)
    if severity is not None:
        query = query.where(CanaryFinding.severity == severity)
    if since is not None:
        query = query.where(CanaryFinding.detected_at >= since)
    query = query.order_by(CanaryFinding.id.desc()).limit(limit)
    return session.scalars(query).all()


def store_probe_runs(session: Session, runs: Iterable[NewProbeRun]) -> list[ProbeRun]:
    rows = [
        ProbeRun(
            run_id=run.run_id,
            kind=run.kind.value,
            engine=run.engine,
            expected=run.expected[:256],
            observed=run.observed[:256],
            passed=run.passed,
            duration_ms=run.duration_ms,
            started_at=run.started_at,
        )
        for run in runs
    ]
    session.add_all(rows)
    session.flush()
    return rows


def list_probe_runs(
    session: Session,
    *,
    kind: str | None = None,
    run_id: str | None = None,
    since: datetime | None = None,
    limit: int = 100,
) -> Sequence[ProbeRun]:
    query = select(ProbeRun)
    if kind is not None:
        query = query.where(ProbeRun.kind == kind)
    if run_id is not None:
        query = query.where(ProbeRun.run_id == run_id)
    if since is not None:
        query = query.where(ProbeRun.started_at >= since)
    return session.scalars(query.order_by(ProbeRun.id.desc()).limit(limit)).all()
