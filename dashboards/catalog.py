"""The dashboards, built from the metric-name modules (alert rules: ``dashboards.alerts``; the
SGLang/vLLM one: ``dashboards.engines``).

A panel is added only for data some module really exports; names are never invented here.
"""

from __future__ import annotations

from backend import metrics as em
from canary import metrics as cm
from dashboards.engines import ENGINES
from dashboards.spec import (
    ENGINE,
    RI,
    TENANT,
    Dashboard,
    Panel,
    _q,
    _quantiles,
    event_count,
    events_in,
    share,
    total,
)
from gateway import metrics as gm


def _inc(by: str, metric: str, matcher: str = ENGINE) -> str:
    """Per-interval events of a counter (first samples included), summed by ``by``."""
    return f"sum by ({by}) ({events_in(metric, RI, matcher)})"


COVERAGE = share(cm.REQUESTS_TOTAL, "tenant", 'marked="true"', TENANT)
PROBE_PASS_RATE = share(cm.PROBE_RESULTS_TOTAL, "engine, kind", 'result="pass"', ENGINE)

ISOLATION = Dashboard(
    uid="kvguard-isolation",
    title="kvguard / Isolation overview",
    variables=("tenant", "engine"),
    panels=(
        Panel(
            "Critical findings (cross-tenant, cross-request)",
            (_q(event_count(cm.FINDINGS_TOTAL, "$__range", 'severity="critical"')),),
            kind="stat",
            description="Any value above 0 is an isolation incident: "
            "see the KvguardCrossTenantFinding alert.",
        ),
        Panel(
            "Findings by kind and severity",
            (
                _q(
                    f"sum by (kind, severity) ({events_in(cm.FINDINGS_TOTAL, RI)})",
                    "{{kind}} / {{severity}}",
                ),
            ),
        ),
        Panel(
            "Streams cut by the leak firewall",
            (
                _q(
                    _inc("engine, kind", cm.CUTS_TOTAL),
                    "{{engine}} {{kind}}",
                ),
            ),
        ),
        Panel(
            "Canary coverage (share of requests carrying a marker)",
            (_q(COVERAGE, "{{tenant}}"),),
            unit="percentunit",
        ),
        Panel(
            "Probe pass rate by engine and kind",
            (_q(PROBE_PASS_RATE, "{{engine}} {{kind}}"),),
            unit="percentunit",
        ),
        Panel(
            "Failing probes (latest result)",
            (
                _q(f"max by (engine, kind) ({cm.PROBE_PASSING}{{{ENGINE}}} == 0)", instant=True),
                _q(f"max by (kind) ({cm.PROBE_LAST_RUN})", instant=True),
            ),
            kind="table",
            description="Probe kinds whose latest run failed, and when each kind last reported.",
        ),
        Panel(
            "Last failing probe",
            (
                _q(
                    f"max by (engine, kind) ({cm.PROBE_LAST_FAILURE}{{{ENGINE}}}) * 1000",
                    instant=True,
                ),
            ),
            kind="table",
            unit="dateTimeAsIso",
            description="When each probe kind last failed on each engine (never failed: no row); "
            "the run's expected vs observed is in GET /admin/canary/probe-runs.",
        ),
        Panel(
            "Quarantined engines",
            (
                _q(
                    f'max by (engine) ({gm.ENGINE_BLOCKED}{{reason="quarantined", {ENGINE}}}) == 1',
                    instant=True,
                ),
            ),
            kind="table",
        ),
        Panel(
            "Engines quarantined by the canary",
            (
                _q(
                    _inc("engine", cm.QUARANTINES_TOTAL),
                    "{{engine}}",
                ),
            ),
        ),
        Panel(
            "Page ownership / generation check failures (engine)",
            (
                _q(
                    _inc("engine, role, reason", total(em.ISOLATION_ERRORS)),
                    "{{engine}} {{role}} {{reason}}",
                ),
            ),
        ),
    ),
)

CAPACITY = Dashboard(
    uid="kvguard-capacity",
    title="kvguard / Capacity truth",
    panels=(
        Panel(
            "Window vs pool vs enforced limit (gateway's view)",
            (
                _q(
                    f"max by (engine, role, kind) ({gm.ENGINE_CAPACITY_TOKENS}{{{ENGINE}}})",
                    instant=True,
                ),
            ),
            kind="table",
            description="kind=window is advertised, kind=pool is measured per role, "
            "kind=enforced is what the gateway admits.",
        ),
        Panel(
            "Engine-reported capacity (tokens)",
            (
                _q(
                    f"max by (engine, role) ({em.CONTEXT_WINDOW}{{{ENGINE}}})",
                    "window {{engine}} {{role}}",
                ),
                _q(
                    f"max by (engine, role) ({em.POOL_TOKENS}{{{ENGINE}}})",
                    "pool {{engine}} {{role}}",
                ),
                _q(
                    f"max by (engine, role) ({em.MAX_REQUEST_TOKENS}{{{ENGINE}}})",
                    "max request {{engine}} {{role}}",
                ),
            ),
        ),
        Panel(
            "Capacity drift (window > real pool)",
            (
                _q(
                    f"max by (engine) ({gm.ENGINE_CAPACITY_DRIFT}{{{ENGINE}}})",
                    "gateway {{engine}}",
                ),
                _q(
                    f"max by (engine, role) ({em.CAPACITY_DRIFT}{{{ENGINE}}})",
                    "engine {{engine}} {{role}}",
                ),
            ),
        ),
        Panel(
            "Fault drills enabled",
            (
                _q(
                    f"max by (engine, role, fault) ({em.FAULT_DRILL}{{{ENGINE}}}) > 0", instant=True
                ),
                _q(f"max by (engine) ({gm.ENGINE_FAULT_DRILLS}{{{ENGINE}}}) > 0", instant=True),
            ),
            kind="table",
        ),
        Panel(
            "Engines not routed to, by reason",
            (_q(f"max by (engine, reason) ({gm.ENGINE_BLOCKED}{{{ENGINE}}}) > 0", instant=True),),
            kind="table",
        ),
        Panel(
            "Rejections by reason (gateway)",
            (_q(_inc("code", gm.REQUESTS_TOTAL, 'code!=""'), "{{code}}"),),
            description="context_length_exceeded, rate_limit_exceeded, no_healthy_engine, ...",
        ),
        Panel(
            "Rejections by reason (engine)",
            (
                _q(
                    _inc("engine, role, code", total(em.REJECTIONS)),
                    "{{engine}} {{role}} {{code}}",
                ),
            ),
        ),
        Panel(
            "Rate-limited requests by limit",
            (_q(_inc("limit", gm.RATE_LIMITED_TOTAL, ""), "{{limit}}"),),
        ),
        Panel(
            "Prompt token counts by method",
            (_q(_inc("method", gm.TOKEN_COUNTS_TOTAL, ""), "{{method}}"),),
            description="local: counted in the gateway (the engine reports the bundled byte "
            "tokenizer); engine: one /tokenize round trip to the engine per count.",
        ),
        Panel(
            "KV pages: free / owned / quarantined",
            (
                _q(
                    f"sum by (engine, role, state) ({em.POOL_PAGES}{{{ENGINE}}})",
                    "{{engine}} {{role}} {{state}}",
                ),
            ),
        ),
        Panel(
            "Capacity report age",
            (
                _q(f"max by (engine) ({gm.ENGINE_CAPACITY_AGE}{{{ENGINE}}})", "gateway {{engine}}"),
                _q(
                    f"max by (engine) ({em.PREFILL_CAPACITY_AGE}{{{ENGINE}}})",
                    "decode's prefill {{engine}}",
                ),
            ),
            unit="s",
        ),
    ),
)

HANDOFF = Dashboard(
    uid="kvguard-handoff",
    title="kvguard / Handoff health (bundled backend)",
    panels=(
        Panel(
            "Handoff outcomes",
            (
                _q(
                    "sum by (engine, role, outcome) "
                    f"(rate({total(em.HANDOFFS)}{{{ENGINE}}}[{RI}]))",
                    "{{engine}} {{role}} {{outcome}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Decode refusals by failed check",
            (
                _q(
                    _inc("engine, check", total(em.HANDOFF_REFUSALS)),
                    "{{engine}} {{check}}",
                ),
            ),
            description="check=transfer_range: reserved != transferred; "
            "page_generations: generation check; checksum: KV digest.",
        ),
        Panel(
            "Reserved vs transferred mismatches",
            (
                _q(
                    _inc("engine", total(em.HANDOFF_TRANSFER_MISMATCH)),
                    "engine {{engine}}",
                ),
                _q(
                    _inc("engine", gm.HANDOFF_MISMATCH_TOTAL),
                    "gateway {{engine}}",
                ),
            ),
        ),
        Panel(
            "Checksum failures and late writes",
            (
                _q(
                    _inc("engine", total(em.HANDOFF_CHECKSUM_FAILURES)),
                    "checksum {{engine}}",
                ),
                _q(
                    _inc("engine", total(em.HANDOFF_LATE_WRITES)),
                    "late write pages {{engine}}",
                ),
            ),
        ),
        Panel(
            "Quarantine drain time (p50/p95/p99)",
            _quantiles(em.DRAIN_SECONDS, "release", ENGINE),
            unit="s",
        ),
        Panel(
            "Pages freed after a drain, by release",
            (
                _q(
                    _inc("engine, release", total(em.DRAINED_PAGES)),
                    "{{engine}} {{release}}",
                ),
                _q(
                    _inc("engine", total(em.QUARANTINE_ABSORBED_WRITES)),
                    "writes landed in quarantine {{engine}}",
                ),
            ),
        ),
        Panel(
            "KV transfer latency (prefill)",
            _quantiles(em.TRANSFER_SECONDS, "engine", ENGINE),
            unit="s",
        ),
        Panel(
            "Handoff latency (decode: sent -> result)",
            _quantiles(em.HANDOFF_SECONDS, "engine", ENGINE),
            unit="s",
        ),
        Panel(
            "Handoffs in progress and staging pages",
            (
                _q(
                    f"sum by (engine, state) ({em.HANDOFFS_ACTIVE}{{{ENGINE}}})",
                    "active {{engine}} {{state}}",
                ),
                _q(
                    f"sum by (engine, state) ({em.STAGING_PAGES}{{{ENGINE}}})",
                    "staging {{engine}} {{state}}",
                ),
            ),
        ),
    ),
)

TRAFFIC = Dashboard(
    uid="kvguard-traffic",
    title="kvguard / Tenant traffic",
    variables=("tenant", "engine"),
    panels=(
        Panel(
            "Requests by outcome",
            (
                _q(
                    f"sum by (tenant, outcome) (rate({gm.REQUESTS_TOTAL}{{{TENANT}}}[{RI}]))",
                    "{{tenant}} {{outcome}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Tokens by kind",
            (
                _q(
                    f"sum by (tenant, kind) (rate({gm.TOKENS_TOTAL}{{{TENANT}}}[{RI}]))",
                    "{{tenant}} {{kind}}",
                ),
            ),
        ),
        Panel(
            "Errors by code",
            (
                _q(
                    _inc("tenant, code", gm.REQUESTS_TOTAL, f'code!="", {TENANT}'),
                    "{{tenant}} {{code}}",
                ),
            ),
        ),
        Panel(
            "Requests in flight",
            (_q(f"sum by (tenant) ({gm.IN_FLIGHT}{{{TENANT}}})", "{{tenant}}"),),
        ),
        Panel(
            "Time to first token by tenant (streamed)",
            _quantiles(gm.TENANT_TTFT_SECONDS, "tenant", f'stream="true", {TENANT}'),
            unit="s",
            description="Request arrival at the gateway -> the first engine event with answer "
            "text, per tenant.",
        ),
        Panel(
            "Inter-token latency by tenant",
            _quantiles(gm.INTER_TOKEN_SECONDS, "tenant", TENANT),
            unit="s",
            description="Gap between consecutive streamed engine events carrying text.",
        ),
        Panel(
            "Time to whole answer by tenant (not streamed)",
            _quantiles(gm.TENANT_TTFT_SECONDS, "tenant", f'stream="false", {TENANT}'),
            unit="s",
        ),
        Panel(
            "Time to first token, gateway (by engine)",
            _quantiles(gm.TTFT_SECONDS, "engine", ENGINE),
            unit="s",
        ),
        Panel(
            "Time to first token, engine", _quantiles(em.TTFT_SECONDS, "engine", ENGINE), unit="s"
        ),
        Panel("Request duration by endpoint", _quantiles(gm.REQUEST_SECONDS, "endpoint"), unit="s"),
        Panel(
            "Gateway overhead before the engine",
            _quantiles(gm.OVERHEAD_SECONDS, "endpoint"),
            unit="s",
        ),
    ),
)

DASHBOARDS = (ISOLATION, CAPACITY, HANDOFF, TRAFFIC, ENGINES)

# Label values Grafana offers in the variables.
VARIABLE_QUERIES = {
    "tenant": f"label_values({gm.REQUESTS_TOTAL}, tenant)",
    "engine": f"label_values({gm.ENGINE_ROUTABLE}, engine)",
}
