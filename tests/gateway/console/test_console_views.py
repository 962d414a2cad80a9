"""What the console's pages read (``gateway.console.views``), with exact expectations, on SQLite.

Proves: the canary's names the console reads by name (the gateway never imports the canary) are
the canary's own -- table names, columns and the quarantining action; the cuts-per-hour chart
counts exactly the audit rows that ended ``cut`` in each of the last 24 hours (none before the
window, no other outcome) and scales its bars to the busiest hour; a quarantined engine is shown
with the time its quarantine began and the finding that caused it, not an earlier one.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gateway_harness import Gateway
from sqlalchemy import insert

from canary.findings import CanaryFinding, NewFinding, ProbeRun, store_finding
from canary.kinds import Action, Evidence, FindingKind, FindingSeverity
from contracts.sql import make_session_factory, run_in_session, session_scope
from gateway.console import views
from gateway.db.models import RequestAudit
from gateway.db.session import make_engine, upgrade_database

NOW = datetime(2026, 5, 1, 12, 30, tzinfo=UTC)


def test_the_canary_names_the_console_reads_are_the_canarys() -> None:
    assert CanaryFinding.__tablename__ == views.FINDINGS
    assert ProbeRun.__tablename__ == views.PROBE_RUNS
    assert set(views.FINDING_COLUMNS) <= set(CanaryFinding.__table__.c.keys())
    assert set(views.PROBE_COLUMNS) <= set(ProbeRun.__table__.c.keys())
    assert Action.CUT_AND_QUARANTINED.value == views.QUARANTINING_ACTION
    # shown to operators: ids, kinds and times only (the expected/observed summaries aside)
    assert not {"evidence_text", "marker", "prompt", "answer"} & set(views.FINDING_COLUMNS)


def _audit(at: datetime, outcome: str, n: int) -> dict[str, object]:
    return {
        "request_id": f"r{n}",
        "tenant_id": "tn_a",
        "key_prefix": None,
        "endpoint": "chat",
        "model": "m",
        "engine": "e",
        "stream": True,
        "prompt_tokens": 1,
        "max_tokens": 1,
        "completion_tokens": 0,
        "outcome": outcome,
        "http_status": 200,
        "error_code": None,
        "handoff_outcome": None,
        "reserved_tokens": None,
        "transferred_tokens": None,
        "started_at": at,
        "ttft_ms": None,
        "duration_ms": 1.0,
    }


def test_cuts_per_hour_counts_the_cut_audit_rows_of_each_hour(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    upgrade_database(engine)
    sessions = make_session_factory(engine)
    first_hour = datetime(2026, 4, 30, 13, 0, tzinfo=UTC)  # 23 hours before 12:00
    rows = [
        _audit(NOW - timedelta(minutes=20), "cut", 1),  # this hour (12:10)
        _audit(NOW - timedelta(minutes=10), "cut", 2),  # this hour (12:20)
        _audit(first_hour + timedelta(minutes=5), "cut", 3),  # the oldest hour shown
        _audit(first_hour - timedelta(minutes=1), "cut", 4),  # before the window
        _audit(NOW - timedelta(minutes=15), "completed", 5),  # not a cut
        _audit(NOW - timedelta(hours=3), "rejected", 6),
    ]
    with session_scope(sessions) as session:
        session.execute(insert(RequestAudit), rows)
    with session_scope(sessions) as session:
        chart = views.cuts_per_hour(session, now=NOW)
    engine.dispose()
    counts = [bar.count for bar in chart.bars]
    assert counts == [1] + [0] * 22 + [2]
    assert (chart.total, chart.peak) == (3, 2)
    assert chart.bars[0].start == first_hour and chart.bars[23].start == datetime(
        2026, 5, 1, 12, tzinfo=UTC
    )
    step = views.CHART_W / views.HOURS
    top, half = chart.bars[23], chart.bars[0]
    assert (top.x, top.width, top.height, top.y) == (round(23 * step + 1, 1), step - 2, 60.0, 4.0)
    assert (half.height, half.y) == (30.0, 34.0)
    assert {bar.height for bar in chart.bars[1:23]} == {0.0}


def _finding(engine: str, action: Action, at: datetime, request: str) -> NewFinding:
    return NewFinding(
        kind=FindingKind.CROSS_TENANT,
        severity=FindingSeverity.CRITICAL,
        evidence=Evidence.CONFIRMED,
        action=action,
        observer_tenant_id="tn_b",
        engine=engine,
        observer_request_id=request,
        victim_tenant_id="tn_a",
        victim_request_id="victim",
        detected_at=at,
    )


async def test_a_quarantined_engine_names_when_and_by_which_finding(gateway: Gateway) -> None:
    state = gateway.state
    earlier = datetime.now(UTC) - timedelta(minutes=5)
    with session_scope(state.sessions) as session:  # an older finding on the same engine
        store_finding(session, _finding("standin", Action.CUT_AND_QUARANTINED, earlier, "old"))
    await state.quarantines.impose("standin", reason="canary: isolation finding on request new")
    later = datetime.now(UTC) + timedelta(milliseconds=1)
    with session_scope(state.sessions) as session:
        store_finding(session, _finding("standin", Action.CUT, later, "cut-only"))
        stored = store_finding(
            session, _finding("standin", Action.CUT_AND_QUARANTINED, later, "new")
        )
        new_id = stored.id
    engines = views.engine_outs(state.registry)
    shown = await run_in_session(
        state.sessions, lambda s: views.isolation(s, engines=engines, now=datetime.now(UTC))
    )
    [row] = shown.engines
    assert row.engine.quarantine_reason == "canary: isolation finding on request new"
    assert row.quarantined_at is not None and earlier < row.quarantined_at <= later
    assert row.finding_id == new_id
    assert [f["observer_request_id"] for f in shown.findings] == ["new", "cut-only", "old"]
    assert shown.canary
