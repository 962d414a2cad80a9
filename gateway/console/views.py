"""What the console's pages show, read from the registry and the database: ids, names, counts and
times -- never a prompt, an answer or a marker (none of the tables read here holds one).

- ``isolation``: each engine's capacity truth and state (the admin API's ``EngineOut``), since when
  and by which finding it is quarantined; the latest findings and probe runs; the firewall's cuts
  per hour (audit rows that ended ``cut``) over the last day, as bars for a server-drawn chart.
- ``tenants`` / ``tenant``: the tenants with their usage (``gateway.services.tenants``: requests,
  tokens and refusals by reason, from the audit rows), one tenant's keys and the actions on it.
- ``engines``: the engines, which of them the console may edit, and the recent operator actions.

Findings and probe runs are the canary's tables (``canary.findings``), on the gateway's database
and metadata; the gateway never imports the canary, so they are looked up by name in the shared
metadata (``contracts.sql.Base``), present whenever the canary is plugged into this gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from contracts.sql import Base
from gateway.api.engine_views import engine_out
from gateway.api.schemas_admin import EngineOut, KeyOut, TenantOut
from gateway.db.models import AdminAction, EngineControl, RequestAudit
from gateway.engines.registry import EngineRegistry, EngineSource
from gateway.lifecycle import Phase
from gateway.services import actions
from gateway.services import keys as key_service
from gateway.services import tenants as tenant_service

FINDINGS, PROBE_RUNS = "canary_findings", "canary_probe_runs"
FINDING_COLUMNS = (
    "id",
    "detected_at",
    "kind",
    "severity",
    "evidence",
    "engine",
    "victim_tenant_id",
    "observer_tenant_id",
    "victim_request_id",
    "observer_request_id",
    "action",
    "detail",
)
PROBE_COLUMNS = ("id", "started_at", "kind", "engine", "passed", "duration_ms", "observed")
QUARANTINING_ACTION = "cut_quarantined"  # canary.kinds.Action.CUT_AND_QUARANTINED's value
HOURS = 24
CHART_W, CHART_H = 480, 64
MAX_CUT_ROWS = 100_000  # each is a leak stopped: far more in a day is itself the news
WINDOWS = {"24h": timedelta(hours=24), "7d": timedelta(days=7), "all": None}


def _canary_table(name: str) -> Table | None:
    return Base.metadata.tables.get(name)


def _rows(
    session: Session, table: Table | None, columns: Sequence[str], limit: int
) -> list[dict[str, Any]]:
    if table is None:
        return []
    query = select(*(table.c[name] for name in columns)).order_by(table.c.id.desc()).limit(limit)
    return [dict(row._mapping) for row in session.execute(query)]


# -- Isolation now ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineRow:
    engine: EngineOut
    quarantined_at: datetime | None
    finding_id: int | None  # the finding that quarantined it, when the canary did


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    count: int
    start: datetime


@dataclass(frozen=True, slots=True)
class CutChart:
    bars: tuple[Bar, ...]
    total: int
    peak: int
    width: int = CHART_W
    height: int = CHART_H


@dataclass(frozen=True, slots=True)
class Isolation:
    engines: list[EngineRow]
    findings: list[dict[str, Any]]
    probes: list[dict[str, Any]]
    cuts: CutChart
    canary: bool  # the canary's tables are known to this gateway


def isolation(
    session: Session, *, engines: list[EngineOut], now: datetime, limit: int = 25
) -> Isolation:
    findings_table = _canary_table(FINDINGS)
    since = _quarantined_at(session, [e.name for e in engines if e.quarantine_reason])
    rows = [
        EngineRow(e, since.get(e.name), _quarantining_finding(session, findings_table, e, since))
        for e in engines
    ]
    return Isolation(
        engines=rows,
        findings=_rows(session, findings_table, FINDING_COLUMNS, limit),
        probes=_rows(session, _canary_table(PROBE_RUNS), PROBE_COLUMNS, limit),
        cuts=cuts_per_hour(session, now=now),
        canary=findings_table is not None,
    )


def _quarantined_at(session: Session, names: list[str]) -> dict[str, datetime]:
    if not names:
        return {}
    query = select(EngineControl.engine_name, EngineControl.quarantined_at).where(
        EngineControl.engine_name.in_(names), EngineControl.quarantined_at.is_not(None)
    )
    return {name: at for name, at in session.execute(query) if at is not None}


def _quarantining_finding(
    session: Session, table: Table | None, engine: EngineOut, since: dict[str, datetime]
) -> int | None:
    """The first finding that quarantined ``engine`` since its quarantine began."""
    at = since.get(engine.name)
    if table is None or engine.quarantine_reason is None or at is None:
        return None
    query = (
        select(table.c.id)
        .where(
            table.c.engine == engine.name,
            table.c.action == QUARANTINING_ACTION,
            table.c.detected_at >= at,
        )
        .order_by(table.c.id)
        .limit(1)
    )
    found = session.scalars(query).first()
    return None if found is None else int(found)


def cuts_per_hour(session: Session, *, now: datetime) -> CutChart:
    """The firewall's cuts (audit rows ending ``cut``) in each of the last ``HOURS`` hours."""
    start = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=HOURS - 1)
    query = (
        select(RequestAudit.started_at)
        .where(RequestAudit.outcome == Phase.CUT.value, RequestAudit.started_at >= start)
        .limit(MAX_CUT_ROWS)
    )
    counts = [0] * HOURS
    for at in session.scalars(query):
        hour = int((at - start).total_seconds() // 3600)
        if 0 <= hour < HOURS:
            counts[hour] += 1
    peak = max(counts)
    step = CHART_W / HOURS
    bars = []
    for hour, count in enumerate(counts):
        height = 0.0 if count == 0 else max(2.0, (CHART_H - 4) * count / peak)
        bars.append(
            Bar(
                x=round(hour * step + 1, 1),
                y=round(CHART_H - height, 1),
                width=round(step - 2, 1),
                height=round(height, 1),
                count=count,
                start=start + timedelta(hours=hour),
            )
        )
    return CutChart(bars=tuple(bars), total=sum(counts), peak=peak)


def engine_outs(registry: EngineRegistry) -> list[EngineOut]:
    """Every engine as the admin API shows it (read on the event loop: the registry is its)."""
    return [engine_out(registry, record) for record in registry.records()]


def editable(registry: EngineRegistry) -> set[str]:
    """Engines the console may change (registered through the admin API or the console)."""
    return {r.name for r in registry.records() if r.source is EngineSource.ADMIN}


# -- Tenants and keys ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantRow:
    tenant: TenantOut
    usage: tenant_service.UsageSummary | None
    refusals: list[tuple[str, int]]


def tenants(session: Session, *, since: datetime | None) -> list[TenantRow]:
    usage = tenant_service.usage_by_tenant(session, since=since)
    refusals = tenant_service.refusals_by_tenant(session, since=since)
    return [
        TenantRow(TenantOut.of(t), usage.get(t.id), refusals.get(t.id, []))
        for t in tenant_service.list_tenants(session)
    ]


@dataclass(frozen=True, slots=True)
class TenantPage:
    row: TenantRow
    keys: list[KeyOut]
    actions: list[AdminAction]


def tenant(session: Session, *, ref: str, since: datetime | None) -> TenantPage:
    found = tenant_service.get_tenant(session, ref=ref)
    usage = tenant_service.usage(session, tenant_id=found.id, since=since, until=None)
    refusals = tenant_service.refusals_by_tenant(session, since=since, tenant_id=found.id)
    keys = [KeyOut.of(k) for k in key_service.list_keys(session, tenant_id=found.id)]
    row = TenantRow(TenantOut.of(found), usage, refusals.get(found.id, []))
    targets = [found.id, *(k.prefix for k in keys)]
    mine = list(actions.recent(session, limit=30, targets=targets))
    return TenantPage(row=row, keys=keys, actions=mine)


def recent_actions(session: Session, *, limit: int = 30) -> list[AdminAction]:
    return list(actions.recent(session, limit=limit))
