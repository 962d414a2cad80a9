"""Findings and probe-run API: admins see all, a tenant sees findings about its own data; probe
reports become rows and metrics. And the canary's own migration steps."""

from __future__ import annotations

from canary_harness import bearer, canary_gateway
from sqlalchemy import inspect

from canary.findings import NewFinding, store_finding
from canary.kinds import Action, Evidence, FindingKind, FindingSeverity
from contracts.sql import session_scope
from gateway.db.session import current_revision, downgrade_database, make_engine, upgrade_database


def _finding(victim: str | None, observer: str, kind=FindingKind.CROSS_TENANT) -> NewFinding:
    return NewFinding(
        kind=kind,
        severity=FindingSeverity.CRITICAL,
        evidence=Evidence.CONFIRMED,
        action=Action.CUT_AND_QUARANTINED,
        observer_tenant_id=observer,
        engine="e1",
        observer_request_id="obs-req",
        victim_tenant_id=victim,
        victim_request_id="vic-req",
        victim_engine="e1",
        key_id=1,
    )


async def test_admins_see_all_findings_tenants_only_their_own(
    gateway_settings, canary_settings
) -> None:
    async with canary_gateway(gateway_settings(), canary_settings()) as gw:
        a_id, a_key = await gw.create_tenant("alpha")
        b_id, b_key = await gw.create_tenant("beta")
        with session_scope(gw.state.sessions) as session:
            store_finding(session, _finding(a_id, b_id))
            store_finding(session, _finding(b_id, a_id))
            store_finding(session, _finding(None, a_id, FindingKind.USAGE_MISMATCH))
        everything = await gw.findings()
        assert [(f["victim_tenant_id"], f["observer_tenant_id"]) for f in everything] == [
            (None, a_id),
            (b_id, a_id),
            (a_id, b_id),
        ]
        assert [f["kind"] for f in await gw.findings(kind="usage_mismatch")] == ["usage_mismatch"]
        assert len(await gw.findings(tenant=a_id)) == 1
        own = (await gw.client.get("/v1/canary/findings", headers=bearer(a_key))).json()
        assert len(own) == 1 and set(own[0]) == {
            "id",
            "detected_at",
            "kind",
            "severity",
            "evidence",
            "victim_request_id",
            "action",
        }
        assert own[0]["victim_request_id"] == "vic-req"
        for params in ({"tenant": b_id}, {"victim_tenant_id": b_id}):
            widened = await gw.client.get(
                "/v1/canary/findings", params=params, headers=bearer(a_key)
            )
            assert [f["id"] for f in widened.json()] == [own[0]["id"]]
        denied = await gw.client.get("/admin/canary/findings", headers=bearer(a_key))
        assert denied.status_code == 401
        anonymous = await gw.client.get("/v1/canary/findings")
        assert anonymous.status_code == 401


async def test_probe_reports_are_stored_served_and_exported(
    gateway_settings, canary_settings
) -> None:
    async with canary_gateway(gateway_settings(), canary_settings()) as gw:
        results = [
            {
                "kind": "capacity",
                "engine": "e1",
                "expected": "limit: 256 of 256 tokens -> 200",
                "observed": "200",
                "passed": True,
                "duration_ms": 12.5,
                "started_at": "2026-09-17T10:00:00+00:00",
            },
            {
                "kind": "echo",
                "engine": "e1",
                "expected": "200, own marker echoed, 0 other",
                "observed": "200, own marker missing, 0 other",
                "passed": False,
                "duration_ms": 40.0,
                "started_at": "2026-09-17T10:00:01+00:00",
            },
        ]
        r = await gw.client.post(
            "/admin/canary/probe-runs",
            json={"run_id": "run1", "results": results},
            headers=gw.admin,
        )
        assert r.status_code == 201, r.text
        listed = (await gw.client.get("/admin/canary/probe-runs", headers=gw.admin)).json()
        assert [(x["run_id"], x["kind"], x["passed"]) for x in listed] == [
            ("run1", "echo", False),
            ("run1", "capacity", True),
        ]
        only = await gw.client.get(
            "/admin/canary/probe-runs", params={"kind": "echo"}, headers=gw.admin
        )
        assert [x["kind"] for x in only.json()] == ["echo"]
        bad = await gw.client.post(
            "/admin/canary/probe-runs",
            json={"run_id": "run2", "results": [{**results[0], "kind": "nope"}]},
            headers=gw.admin,
        )
        assert bad.status_code == 400
        metrics = await gw.metrics()
        assert (
            'kvguard_canary_probe_results_total{engine="e1",kind="capacity",result="pass"} 1.0'
            in metrics
        )
        assert (
            'kvguard_canary_probe_results_total{engine="e1",kind="echo",result="fail"} 1.0'
            in metrics
        )
        assert 'kvguard_canary_probe_passing{engine="e1",kind="echo"} 0.0' in metrics
        assert 'kvguard_canary_probe_last_run_timestamp_seconds{kind="echo"}' in metrics
        last_failure = "kvguard_canary_probe_last_failure_timestamp_seconds"
        assert last_failure + '{engine="e1",kind="echo"}' in metrics
        assert last_failure + '{engine="e1",kind="capacity"}' not in metrics  # it passed


def test_canary_revisions_step_up_and_down_alone(postgres_url) -> None:
    engine = make_engine(postgres_url)
    try:
        upgrade_database(engine, "0006_create_engine_controls")
        upgrade_database(engine, "0007_create_canary_findings")
        assert "canary_findings" in inspect(engine).get_table_names()
        assert "canary_probe_runs" not in inspect(engine).get_table_names()
        upgrade_database(engine, "0008_create_canary_probe_runs")
        assert current_revision(engine) == "0008_create_canary_probe_runs"
        downgrade_database(engine, "0006_create_engine_controls")
        tables = set(inspect(engine).get_table_names())
        assert not tables & {"canary_findings", "canary_probe_runs"} and "engine_controls" in tables
    finally:
        engine.dispose()
