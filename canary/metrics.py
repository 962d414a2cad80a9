"""Every Prometheus metric the canary exports: names in one place.

The gateway's ``/metrics`` serves them (``CanaryMetrics`` registers on the gateway's registry when
the canary starts). Labels carry ids (tenant id, engine name, kinds), never content. Coverage of a
tenant = ``requests_total{marked="true"}`` / all of its ``requests_total``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from contracts.metrics import Children, Tally

FINDINGS_TOTAL = "kvguard_canary_findings_total"
REQUESTS_TOTAL = "kvguard_canary_requests_total"
MARKERS_INJECTED_TOTAL = "kvguard_canary_markers_injected_total"
CUTS_TOTAL = "kvguard_canary_cuts_total"
QUARANTINES_TOTAL = "kvguard_canary_quarantines_total"
RECORD_ERRORS_TOTAL = "kvguard_canary_record_errors_total"
FINDINGS_LOST_TOTAL = "kvguard_canary_findings_lost_total"
PROBE_RESULTS_TOTAL = "kvguard_canary_probe_results_total"
PROBE_PASSING = "kvguard_canary_probe_passing"
PROBE_LAST_RUN = "kvguard_canary_probe_last_run_timestamp_seconds"
PROBE_LAST_FAILURE = "kvguard_canary_probe_last_failure_timestamp_seconds"

METRIC_NAMES = (
    FINDINGS_TOTAL,
    REQUESTS_TOTAL,
    MARKERS_INJECTED_TOTAL,
    CUTS_TOTAL,
    QUARANTINES_TOTAL,
    RECORD_ERRORS_TOTAL,
    FINDINGS_LOST_TOTAL,
    PROBE_RESULTS_TOTAL,
    PROBE_PASSING,
    PROBE_LAST_RUN,
    PROBE_LAST_FAILURE,
)


def _name(full: str) -> str:
    """prometheus_client appends ``_total`` to counters itself."""
    return full.removesuffix("_total")


class CanaryMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # the request path's updates (``later``), applied before any metric below is read
        self.tally = Tally()
        r.register(self.tally)
        self.later = self.tally.add
        self.findings = Counter(
            _name(FINDINGS_TOTAL),
            "Isolation findings by kind and severity",
            ["kind", "severity"],
            registry=r,
        )
        self.requests = Counter(
            _name(REQUESTS_TOTAL),
            "Tenant requests seen by the canary, by whether they carried a marker",
            ["tenant", "marked"],
            registry=r,
        )
        self.injected = Counter(
            _name(MARKERS_INJECTED_TOTAL),
            "Markers the gateway injected into tenant requests",
            ["tenant"],
            registry=r,
        )
        # the request path's children, by label values in the order declared (``Children``),
        # updated through ``later``
        self.requests_of = Children(self.requests)  # tenant, marked
        self.injected_of = Children(self.injected)  # tenant
        self.cuts = Counter(
            _name(CUTS_TOTAL),
            "Responses the leak firewall stopped, by engine and finding kind",
            ["engine", "kind"],
            registry=r,
        )
        self.quarantines = Counter(
            _name(QUARANTINES_TOTAL),
            "Engines taken out of routing by the canary",
            ["engine"],
            registry=r,
        )
        self.record_errors = Counter(
            _name(RECORD_ERRORS_TOTAL),
            "Marker issue records that could not be written or read",
            registry=r,
        )
        self.findings_lost = Counter(
            _name(FINDINGS_LOST_TOTAL),
            "Findings neither spooled to local disk nor stored (logged at ERROR with their ids)",
            registry=r,
        )
        self._probe_metrics(r)

    def _probe_metrics(self, r: CollectorRegistry) -> None:
        self.probe_results = Counter(
            _name(PROBE_RESULTS_TOTAL),
            "Probe results by kind, engine and result (pass/fail)",
            ["kind", "engine", "result"],
            registry=r,
        )
        self.probe_passing = Gauge(
            PROBE_PASSING,
            "1 when the latest probe of this kind on this engine passed",
            ["kind", "engine"],
            registry=r,
        )
        self.probe_last_run = Gauge(
            PROBE_LAST_RUN, "When a probe of this kind last reported", ["kind"], registry=r
        )
        self.probe_last_failure = Gauge(
            PROBE_LAST_FAILURE,
            "When a probe of this kind last failed on this engine (no series: never failed)",
            ["kind", "engine"],
            registry=r,
        )
