"""Every Prometheus metric the gateway exports: names in one place, one registry per app.

Labels carry ids (tenant id, engine name, model, outcome, code), never content. Dashboards and
alert rules are checked against the names listed in ``METRIC_NAMES``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from contracts.metrics import Children, Tally

REQUESTS_TOTAL = "kvguard_gateway_requests_total"
REQUEST_SECONDS = "kvguard_gateway_request_duration_seconds"
TTFT_SECONDS = "kvguard_gateway_time_to_first_token_seconds"
TENANT_TTFT_SECONDS = "kvguard_gateway_tenant_time_to_first_token_seconds"
INTER_TOKEN_SECONDS = "kvguard_gateway_inter_token_latency_seconds"
OVERHEAD_SECONDS = "kvguard_gateway_overhead_seconds"
TOKENS_TOTAL = "kvguard_gateway_tokens_total"
RATE_LIMITED_TOTAL = "kvguard_gateway_rate_limited_total"
IN_FLIGHT = "kvguard_gateway_in_flight_requests"
LIMITER_UP = "kvguard_gateway_limiter_up"
LIMITER_FAIL_OPEN_TOTAL = "kvguard_gateway_limiter_fail_open_total"
ENGINE_ROUTABLE = "kvguard_gateway_engine_routable"
ENGINE_BLOCKED = "kvguard_gateway_engine_blocked"
ENGINE_CAPACITY_TOKENS = "kvguard_gateway_engine_capacity_tokens"
ENGINE_CAPACITY_DRIFT = "kvguard_gateway_engine_capacity_drift"
ENGINE_FAULT_DRILLS = "kvguard_gateway_engine_fault_drills"
ENGINE_CAPACITY_AGE = "kvguard_gateway_engine_capacity_age_seconds"
ENGINE_POLL_ERRORS_TOTAL = "kvguard_gateway_engine_poll_errors_total"
HANDOFF_MISMATCH_TOTAL = "kvguard_gateway_handoff_mismatch_total"
AUDIT_DROPPED_TOTAL = "kvguard_gateway_audit_dropped_total"
AUDIT_SET_ASIDE_TOTAL = "kvguard_gateway_audit_set_aside_total"
TOKEN_COUNTS_TOTAL = "kvguard_gateway_token_counts_total"

METRIC_NAMES = (
    REQUESTS_TOTAL,
    REQUEST_SECONDS,
    TTFT_SECONDS,
    TENANT_TTFT_SECONDS,
    INTER_TOKEN_SECONDS,
    OVERHEAD_SECONDS,
    TOKENS_TOTAL,
    RATE_LIMITED_TOTAL,
    IN_FLIGHT,
    LIMITER_UP,
    LIMITER_FAIL_OPEN_TOTAL,
    ENGINE_ROUTABLE,
    ENGINE_BLOCKED,
    ENGINE_CAPACITY_TOKENS,
    ENGINE_CAPACITY_DRIFT,
    ENGINE_FAULT_DRILLS,
    ENGINE_CAPACITY_AGE,
    ENGINE_POLL_ERRORS_TOTAL,
    HANDOFF_MISMATCH_TOTAL,
    AUDIT_DROPPED_TOTAL,
    AUDIT_SET_ASIDE_TOTAL,
    TOKEN_COUNTS_TOTAL,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class GapHistogram(Collector):
    """A per-tenant histogram recorded a whole stream at a time: ``record`` adds the bucket counts
    and the sum of one request's gaps (``gateway.proxy.stream.TokenClock``) at its exit, instead
    of one observation per streamed event. Exposed like any ``Histogram`` (``_bucket``,
    ``_count``, ``_sum`` with the ``tenant`` label)."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(bounds)
        self._series: dict[str, tuple[list[int], list[float]]] = {}
        self._lock = threading.Lock()  # a scrape may run in another thread

    def record(self, tenant: str, counts: Sequence[int], total: float) -> None:
        """``counts[i]``: gaps of at most ``bounds[i]`` (and above the one before); the last: above
        every bound."""
        with self._lock:
            series = self._series.get(tenant)
            if series is None:
                series = self._series[tenant] = ([0] * (len(self.bounds) + 1), [0.0])
            buckets, sums = series
            for i, count in enumerate(counts):
                buckets[i] += count
            sums[0] += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["tenant"])
        with self._lock:
            series = [(t, list(b), s[0]) for t, (b, s) in self._series.items()]
        for tenant, buckets, total in series:
            cumulative, rows = 0, []
            for bound, count in zip((*self.bounds, float("inf")), buckets, strict=True):
                cumulative += count
                rows.append((_bound(bound), float(cumulative)))
            family.add_metric([tenant], rows, total)
        yield family


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


def _name(full: str) -> str:
    """prometheus_client appends ``_total`` to counters itself."""
    return full.removesuffix("_total")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # the request path's updates (``later``), applied before any metric below is read
        self.tally = Tally()
        r.register(self.tally)
        self.later = self.tally.add
        self.requests = Counter(
            _name(REQUESTS_TOTAL),
            "Tenant requests by outcome and error code",
            ["tenant", "endpoint", "outcome", "code"],
            registry=r,
        )
        self.request_seconds = Histogram(
            REQUEST_SECONDS,
            "Whole request duration",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            TTFT_SECONDS,
            "Time to the first streamed byte",
            ["engine"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_ttft_seconds = Histogram(
            TENANT_TTFT_SECONDS,
            "Request arrival -> the first answer text, per tenant (stream=false: the whole answer)",
            ["tenant", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_seconds = GapHistogram(
            INTER_TOKEN_SECONDS,
            "Gap between consecutive streamed engine events carrying text, per tenant",
            LATENCY_BUCKETS,
        )
        r.register(self.inter_token_seconds)
        self.overhead_seconds = Histogram(
            OVERHEAD_SECONDS,
            "Gateway work before the engine is called (auth, count, limits)",
            ["endpoint"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            _name(TOKENS_TOTAL),
            "Tokens by tenant and kind (prompt/completion)",
            ["tenant", "kind"],
            registry=r,
        )
        self.rate_limited = Counter(
            _name(RATE_LIMITED_TOTAL),
            "Requests refused by a tenant limit",
            ["tenant", "limit"],
            registry=r,
        )
        self.in_flight = Gauge(IN_FLIGHT, "Requests in flight", ["tenant"], registry=r)
        # the request path's metrics, by label values in the order declared above (``Children``)
        self.requests_of = Children(self.requests)  # tenant, endpoint, outcome, code
        self.request_seconds_of = Children(self.request_seconds)  # endpoint
        self.ttft_seconds_of = Children(self.ttft_seconds)  # engine
        self.tenant_ttft_seconds_of = Children(self.tenant_ttft_seconds)  # tenant, stream
        self.overhead_seconds_of = Children(self.overhead_seconds)  # endpoint
        self.tokens_of = Children(self.tokens)  # tenant, kind
        self.in_flight_of = Children(self.in_flight)  # tenant
        self.limiter_up = Gauge(LIMITER_UP, "1 when the limiter backend answers", registry=r)
        self.limiter_fail_open = Counter(
            _name(LIMITER_FAIL_OPEN_TOTAL),
            "Requests let through while the limiter was down",
            registry=r,
        )
        self._engine_metrics(r)

    def _engine_metrics(self, r: CollectorRegistry) -> None:
        self.engine_routable = Gauge(
            ENGINE_ROUTABLE, "1 when the engine may serve requests", ["engine"], registry=r
        )
        self.engine_blocked = Gauge(
            ENGINE_BLOCKED,
            "1 for the reason an engine is not routed to",
            ["engine", "reason"],
            registry=r,
        )
        self.engine_capacity = Gauge(
            ENGINE_CAPACITY_TOKENS,
            "Engine capacity in tokens: window (advertised), pool (real, per role), enforced",
            ["engine", "role", "kind"],
            registry=r,
        )
        self.engine_drift = Gauge(
            ENGINE_CAPACITY_DRIFT,
            "1 when the advertised window exceeds the real pool",
            ["engine"],
            registry=r,
        )
        self.engine_faults = Gauge(
            ENGINE_FAULT_DRILLS, "Fault drills the engine reports enabled", ["engine"], registry=r
        )
        self.engine_age = Gauge(
            ENGINE_CAPACITY_AGE,
            "Seconds since the last good capacity snapshot",
            ["engine"],
            registry=r,
        )
        self.engine_poll_errors = Counter(
            _name(ENGINE_POLL_ERRORS_TOTAL), "Failed capacity polls", ["engine"], registry=r
        )
        self.handoff_mismatch = Counter(
            _name(HANDOFF_MISMATCH_TOTAL),
            "Responses whose handoff proof showed reserved != transferred tokens",
            ["engine"],
            registry=r,
        )
        self.audit_dropped = Counter(
            _name(AUDIT_DROPPED_TOTAL), "Audit rows dropped (writer backlog full)", registry=r
        )
        self.audit_set_aside = Counter(
            _name(AUDIT_SET_ASIDE_TOTAL),
            "Audit rows the database refused, set aside (logged by request id) so the rest land",
            registry=r,
        )
        self.token_counts = Counter(
            _name(TOKEN_COUNTS_TOTAL),
            "Prompt token counts by method: local (the engine's countable tokenizer, applied "
            "here) or engine (its /tokenize)",
            ["method"],
            registry=r,
        )
        self.token_counts_of = Children(self.token_counts)  # method
