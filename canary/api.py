"""The canary's HTTP API, mounted by the gateway: findings and probe runs.

- ``GET /admin/canary/findings`` (``/{id}`` for one) and ``GET /admin/canary/probe-runs``: admins
  see everything (``kvguard canary findings|finding|probe-runs`` read them).
- ``POST /admin/canary/probe-runs``: ``kvguard canary probe`` reports its results (admin token).
- ``GET /v1/canary/findings``: a tenant sees the findings about its own data (it was the victim),
  without the ids of the tenant that received it or of the engine.

Plain ``def`` routes: FastAPI runs them in its threadpool, next to the synchronous DB session.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, status
from pydantic import BaseModel, ConfigDict, Field

from canary.findings import (
    CanaryFinding,
    NewProbeRun,
    ProbeKind,
    ProbeRun,
    list_findings,
    list_probe_runs,
    store_probe_runs,
)
from canary.kinds import FindingKind, FindingSeverity
from canary.metrics import CanaryMetrics
from gateway.api.timestamps import Instant
from gateway.db.text import StoredText
from gateway.deps import AdminDep, CurrentTenant, SessionDep
from gateway.errors import NotFound

Limit = Annotated[int, Query(ge=1, le=1000)]
RowId = Annotated[int, Path(ge=1, le=2**63 - 1)]  # a row id fits the 64-bit column (else a 500)


class FindingOut(BaseModel):
    id: int
    detected_at: datetime
    kind: str
    severity: str
    evidence: str
    victim_tenant_id: str | None
    observer_tenant_id: str | None
    engine: str | None
    observer_request_id: str | None
    victim_request_id: str | None
    victim_engine: str | None
    key_id: int | None
    action: str
    detail: str | None

    @classmethod
    def of(cls, row: CanaryFinding) -> FindingOut:
        return cls.model_validate(row, from_attributes=True)


class TenantFindingOut(BaseModel):
    """What a victim tenant may know: that its data showed up elsewhere, when, and from which
    of its requests; not who received it."""

    id: int
    detected_at: datetime
    kind: str
    severity: str
    evidence: str
    victim_request_id: str | None
    action: str

    @classmethod
    def of(cls, row: CanaryFinding) -> TenantFindingOut:
        return cls.model_validate(row, from_attributes=True)


class ProbeResultIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Annotated[ProbeKind, Field(strict=False)]
    engine: StoredText | None = Field(default=None, max_length=64)
    expected: StoredText = Field(max_length=256)
    observed: StoredText = Field(max_length=256)
    passed: bool
    duration_ms: float = Field(ge=0)
    started_at: Annotated[Instant, Field(strict=False)]


class ProbeRunIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    run_id: str = Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$")
    results: list[ProbeResultIn] = Field(min_length=1, max_length=100)


class ProbeRunOut(BaseModel):
    id: int
    run_id: str
    kind: str
    engine: str | None
    expected: str
    observed: str
    passed: bool
    duration_ms: float
    started_at: datetime

    @classmethod
    def of(cls, row: ProbeRun) -> ProbeRunOut:
        return cls.model_validate(row, from_attributes=True)


def build_router(metrics: CanaryMetrics) -> APIRouter:
    router = APIRouter(tags=["canary"])
    _finding_routes(router)
    _probe_routes(router, metrics)
    return router


def _finding_routes(router: APIRouter) -> None:
    @router.get("/admin/canary/findings")
    def all_findings(
        session: SessionDep,
        _: AdminDep,
        kind: FindingKind | None = None,
        severity: FindingSeverity | None = None,
        tenant: str | None = None,
        since: Instant | None = None,
        limit: Limit = 100,
    ) -> list[FindingOut]:
        rows = list_findings(
            session,
            victim_tenant_id=tenant,
            kind=None if kind is None else kind.value,
            severity=None if severity is None else severity.value,
            since=since,
            limit=limit,
        )
        return [FindingOut.of(row) for row in rows]

    @router.get("/admin/canary/findings/{finding_id}")
    def one_finding(finding_id: RowId, session: SessionDep, _: AdminDep) -> FindingOut:
        row = session.get(CanaryFinding, finding_id)
        if row is None:
            raise NotFound(f"no finding {finding_id}", code="finding_not_found")
        return FindingOut.of(row)

    @router.get("/v1/canary/findings")
    def own_findings(
        session: SessionDep,
        principal: CurrentTenant,
        since: Instant | None = None,
        limit: Limit = 100,
    ) -> list[TenantFindingOut]:
        # The key decides the tenant; no parameter can widen it.
        rows = list_findings(
            session, victim_tenant_id=principal.tenant_id, since=since, limit=limit
        )
        return [TenantFindingOut.of(row) for row in rows]


def _probe_routes(router: APIRouter, metrics: CanaryMetrics) -> None:
    @router.get("/admin/canary/probe-runs")
    def probe_runs(
        session: SessionDep,
        _: AdminDep,
        kind: ProbeKind | None = None,
        run_id: str | None = None,
        since: Instant | None = None,
        limit: Limit = 100,
    ) -> list[ProbeRunOut]:
        kind_value = None if kind is None else kind.value
        rows = list_probe_runs(session, kind=kind_value, run_id=run_id, since=since, limit=limit)
        return [ProbeRunOut.of(row) for row in rows]

    @router.post("/admin/canary/probe-runs", status_code=status.HTTP_201_CREATED)
    def report_probe_runs(body: ProbeRunIn, session: SessionDep, _: AdminDep) -> list[ProbeRunOut]:
        runs = [
            NewProbeRun(
                run_id=body.run_id,
                kind=result.kind,
                engine=result.engine,
                expected=result.expected,
                observed=result.observed,
                passed=result.passed,
                duration_ms=result.duration_ms,
                started_at=result.started_at,
            )
            for result in body.results
        ]
        rows = store_probe_runs(session, runs)
        now = time.time()
        for run in runs:
            engine = run.engine or "unknown"
            outcome = "pass" if run.passed else "fail"
            metrics.probe_results.labels(kind=run.kind.value, engine=engine, result=outcome).inc()
            metrics.probe_passing.labels(kind=run.kind.value, engine=engine).set(int(run.passed))
            metrics.probe_last_run.labels(kind=run.kind.value).set(now)
            if not run.passed:
                metrics.probe_last_failure.labels(kind=run.kind.value, engine=engine).set(now)
        return [ProbeRunOut.of(row) for row in rows]
