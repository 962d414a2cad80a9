"""Every Prometheus metric the engine exports, by name, in one place.

Engine metrics carry no tenant label and never content: ids and counts go to logs, and the
gateway (which owns tenancy) exports per-tenant series. Dashboards and alert rules are checked
against the names defined here.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "kvguard_engine_"

REQUESTS = PREFIX + "requests"  # counter {outcome}
REJECTIONS = PREFIX + "rejections"  # counter {code}
ISOLATION_ERRORS = PREFIX + "isolation_errors"  # counter {reason}
PROMPT_TOKENS = PREFIX + "prompt_tokens"  # counter
GENERATED_TOKENS = PREFIX + "generated_tokens"  # counter
ZEROED_PAGES = PREFIX + "zeroed_pages"  # counter
POOL_PAGES = PREFIX + "pool_pages"  # gauge {state}
POOL_TOKENS = PREFIX + "pool_tokens"  # gauge
CONTEXT_WINDOW = PREFIX + "context_window_tokens"  # gauge
MAX_REQUEST_TOKENS = PREFIX + "max_request_tokens"  # gauge
CAPACITY_DRIFT = PREFIX + "capacity_drift"  # gauge 0/1
FAULT_DRILL = PREFIX + "fault_drill_enabled"  # gauge {fault}
STEP_SECONDS = PREFIX + "step_seconds"  # histogram {phase}
TTFT_SECONDS = PREFIX + "time_to_first_token_seconds"  # histogram

_STEP_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    """The engine's series on a registry of their own (several engines may share a process)."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, {"role": role}
        self.requests = Counter(REQUESTS, "Requests by terminal outcome", ["outcome"], registry=r)
        self.rejections = Counter(REJECTIONS, "Requests refused by code", ["code"], registry=r)
        self.isolation_errors = Counter(
            ISOLATION_ERRORS, "Page ownership/generation check failures", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens admitted", registry=r)
        self.generated_tokens = Counter(GENERATED_TOKENS, "Tokens sampled", registry=r)
        self.zeroed_pages = Counter(ZEROED_PAGES, "Pages zeroed on free", registry=r)
        self.pool_pages = Gauge(POOL_PAGES, "KV pages by state", ["state"], registry=r)
        self.pool_tokens = Gauge(POOL_TOKENS, "Real KV pool size in tokens", registry=r)
        self.context_window = Gauge(CONTEXT_WINDOW, "Advertised context window", registry=r)
        self.max_request_tokens = Gauge(
            MAX_REQUEST_TOKENS, "Largest prompt + max_tokens accepted", registry=r
        )
        self.capacity_drift = Gauge(
            CAPACITY_DRIFT, "1 when the advertised window exceeds the real pool", registry=r
        )
        self.fault_drill = Gauge(FAULT_DRILL, "Enabled fault drills", ["fault"], registry=r)
        self.step_seconds = Histogram(
            STEP_SECONDS, "Engine step phases", ["phase"], buckets=_STEP_BUCKETS, registry=r
        )
        self.ttft_seconds = Histogram(
            TTFT_SECONDS, "Time to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.role = labels["role"]

    def track_pool(
        self, free: Callable[[], int], owned: Callable[[], int], quarantined: Callable[[], int]
    ) -> None:
        self.pool_pages.labels("free").set_function(free)
        self.pool_pages.labels("owned").set_function(owned)
        self.pool_pages.labels("quarantined").set_function(quarantined)
