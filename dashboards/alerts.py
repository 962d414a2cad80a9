"""Prometheus alert rules: what each one means and the first response (docs/operations.md)."""

from __future__ import annotations

from backend import metrics as em
from canary import metrics as cm
from dashboards.spec import CANARY_COVERAGE_TARGET, AlertRule, events, events_in, share, total
from gateway import metrics as gm

_COVERAGE_15M = share(cm.REQUESTS_TOTAL, "tenant", 'marked="true"', window="15m")
# An engine's drills where that engine runs in production mode; and drills the gateway sees on an
# engine whose own series Prometheus does not scrape (its mode unknown: alert rather than guess).
_DRILL_IN_PRODUCTION = (
    f"max by (engine, role, fault) ({em.FAULT_DRILL} > 0 "
    f'and on (engine, role) {em.MODE}{{mode="production"}} == 1) '
    f"or (max by (engine) ({gm.ENGINE_FAULT_DRILLS}) > 0 unless on (engine) {em.MODE})"
)

ALERTS = (
    AlertRule(
        name="KvguardCrossTenantFinding",
        expr=events(cm.FINDINGS_TOTAL, "kind, severity", "5m", 'severity="critical"'),
        severity="critical",
        summary="A response carried another tenant's (or request's) canary marker",
        first_response="Treat as a data-exposure incident. The firewall cut the stream and, when "
        "the evidence showed the engine produced the marker, quarantined it: keep it out of "
        "routing, read the finding (GET /admin/canary/findings; its detail says why an engine was "
        "not quarantined), check the engine's fault drills and capacity drift, preserve logs, "
        "then notify the affected tenants per policy.",
    ),
    AlertRule(
        name="KvguardCanaryFindingLost",
        expr=f"sum({events_in(cm.FINDINGS_LOST_TOTAL, '10m')}) > 0",
        severity="critical",
        summary="An isolation finding could be neither spooled to local disk nor stored",
        first_response="The gateway log has it at ERROR ('canary finding LOST', with its ids): "
        "record it by hand, then fix the gateway's data dir (disk full or read-only) and database.",
    ),
    AlertRule(
        name="KvguardLeakFirewallCut",
        expr=events(cm.CUTS_TOTAL, "engine, kind", "5m"),
        severity="critical",
        summary="The leak firewall cut a response stream on an engine",
        first_response="Same as KvguardCrossTenantFinding: the engine that served the stream is "
        "suspect; confirm it is quarantined and start the incident.",
    ),
    AlertRule(
        name="KvguardFaultDrillEnabled",
        expr=_DRILL_IN_PRODUCTION,
        severity="critical",
        summary="An engine in production mode runs with a fault drill that removes an isolation "
        "defence",
        first_response="Drills belong on drill environments only (engines with "
        "KVGUARD_MODE=development: their drills show on the Capacity truth dashboard without "
        "alerting; an engine the gateway reports with drills but Prometheus does not scrape "
        "alerts too). Restart the engine without --allow-fault-drills/--fault (KVGUARD_FAULTS "
        "empty); the gateway does not route to it meanwhile.",
    ),
    AlertRule(
        name="KvguardCapacityDrift",
        expr=(
            f"max by (engine) ({gm.ENGINE_CAPACITY_DRIFT}) == 1 "
            f"or max by (engine, role) ({em.CAPACITY_DRIFT}) == 1"
        ),
        severity="warning",
        summary="An engine advertises a context window larger than its real KV pool",
        first_response="The gateway already enforces the smaller real limit. Fix the engine's "
        "configuration (context window <= pool of every role: --context-window, "
        "--pool-tokens) and restart it without --allow-capacity-drift.",
        for_="1m",
    ),
    AlertRule(
        name="KvguardHandoffProofFailure",
        expr=" or ".join(
            events(name, "engine", "5m")
            for name in (
                total(em.HANDOFF_TRANSFER_MISMATCH),
                total(em.HANDOFF_CHECKSUM_FAILURES),
                total(em.ISOLATION_ERRORS),
                gm.HANDOFF_MISMATCH_TOTAL,
            )
        ),
        severity="critical",
        summary="A prefill->decode handoff failed its proof (range, generation or checksum)",
        first_response="The request was refused, not answered. Check the Handoff health "
        "dashboard for which check failed; look for a prefill/decode version skew, a drill, "
        "or a transport fault; drain the pair if failures continue.",
    ),
    AlertRule(
        name="KvguardEngineQuarantined",
        expr=f'max by (engine) ({gm.ENGINE_BLOCKED}{{reason="quarantined"}}) == 1',
        severity="critical",
        summary="An engine is quarantined and receives no traffic",
        first_response="Find why (the finding that triggered it: the console's Isolation now "
        "page names it), fix the engine, then clear the quarantine with a reason (the console's "
        "Engines page, or DELETE /admin/engines/<name>/quarantine); capacity now rests on the "
        "other engines.",
    ),
    AlertRule(
        name="KvguardProbeFailing",
        expr=f"max by (engine, kind) ({cm.PROBE_PASSING}) == 0",
        severity="critical",
        summary="A canary probe's latest run failed on an engine",
        first_response="Open the probe result (kind, engine, expected vs got). A failed "
        "capacity probe means the enforced limit is wrong; a failed echo or cross-tenant "
        "probe is a possible leak: quarantine the engine until it passes.",
        for_="2m",
    ),
    AlertRule(
        name="KvguardProbesStale",
        expr=f"time() - max by (kind) ({cm.PROBE_LAST_RUN}) > 600",
        severity="warning",
        summary="A probe kind has not reported for 10 minutes",
        first_response="Check the canary-probe runner (its logs, KVGUARD_CANARY_GATEWAY_URL, "
        "the admin token); without probes, isolation is unverified.",
    ),
    AlertRule(
        name="KvguardCanaryCoverageLow",
        expr=f"{_COVERAGE_15M} < {CANARY_COVERAGE_TARGET}",
        severity="warning",
        summary=f"Less than {CANARY_COVERAGE_TARGET:.0%} of a tenant's requests carry a marker",
        first_response="Raise the tenant's canary sample rate (kvguard admin tenant create "
        "--canary-sample-rate) or check that the canary is enabled (KVGUARD_CANARY_ENABLED).",
        for_="30m",
    ),
    AlertRule(
        name="KvguardEngineNotRoutable",
        expr=(
            f"max by (engine, reason) ({gm.ENGINE_BLOCKED}"
            '{reason=~"unreachable|unavailable|unknown_capacity|stale_capacity"}) == 1'
        ),
        severity="warning",
        summary="The gateway cannot verify an engine's capacity and does not route to it",
        first_response="Check the engine's /health and /engine/capacity from a gateway host; "
        "requests go to the other engines (or fail with no_healthy_engine).",
        for_="2m",
    ),
    AlertRule(
        name="KvguardLimiterDown",
        expr=f"min({gm.LIMITER_UP}) == 0",
        severity="warning",
        summary="A gateway replica cannot reach Redis for tenant limits",
        first_response="Check Redis. With KVGUARD_LIMITER_FAIL_OPEN=false requests are refused "
        "(limiter_unavailable) until it is back.",
        for_="1m",
    ),
    AlertRule(
        name="KvguardAuditDropped",
        expr=f"sum(increase({gm.AUDIT_DROPPED_TOTAL}[10m])) > 0",
        severity="warning",
        summary="Audit rows were dropped (writer backlog full)",
        first_response="Check database latency and the gateway's audit flush interval.",
    ),
    AlertRule(
        name="KvguardAuditRowsSetAside",
        expr=f"sum(increase({gm.AUDIT_SET_ASIDE_TOTAL}[10m])) > 0",
        severity="warning",
        summary="The database refused audit rows; they were set aside so the rest could land",
        first_response="Search the gateway log for 'set aside' (request ids and the error class) "
        "and fix what produced the value.",
    ),
)
