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
PREEMPTIONS = PREFIX + "preemptions"  # counter: running requests whose pages were taken back
PREFIX_CACHE_TOKENS = PREFIX + "prefix_cache_tokens"  # counter {result}: hit|miss at admission
POOL_PAGES = PREFIX + "pool_pages"  # gauge {state}
POOL_TOKENS = PREFIX + "pool_tokens"  # gauge
CONTEXT_WINDOW = PREFIX + "context_window_tokens"  # gauge
MAX_REQUEST_TOKENS = PREFIX + "max_request_tokens"  # gauge
CAPACITY_DRIFT = PREFIX + "capacity_drift"  # gauge 0/1
FAULT_DRILL = PREFIX + "fault_drill_enabled"  # gauge {fault}
MODE = PREFIX + "mode"  # gauge {mode}: 1 for the KVGUARD_MODE the engine runs in
STEP_SECONDS = PREFIX + "step_seconds"  # histogram {phase}
TTFT_SECONDS = PREFIX + "time_to_first_token_seconds"  # histogram
# The prefill -> decode handoff (backend.disagg).
HANDOFFS = PREFIX + "handoffs"  # counter {outcome}: ok|rejected|aborted|failed|lost|timeout|...
HANDOFF_REFUSALS = PREFIX + "handoff_refusals"  # counter {check}: decode found no evidence
HANDOFF_TRANSFER_MISMATCH = PREFIX + "handoff_transfer_mismatch"  # counter: reserved != sent
HANDOFF_CHECKSUM_FAILURES = PREFIX + "handoff_checksum_failures"  # counter
HANDOFF_LATE_WRITES = PREFIX + "handoff_late_write_pages"  # counter: written after release
QUARANTINE_ABSORBED_WRITES = PREFIX + "quarantine_absorbed_write_pages"  # counter: landed held
HANDOFF_SECONDS = PREFIX + "handoff_seconds"  # histogram: decode, request sent -> result
TRANSFER_SECONDS = PREFIX + "kv_transfer_seconds"  # histogram: prefill, all batches of one
CHECKSUM_SECONDS = PREFIX + "kv_checksum_seconds"  # histogram
# histogram {phase}: the sealed channel's work per handoff. Prefill: seal. Decode: register (the
# landing slots), copy (of the withdrawn slots), unseal (open every page), move (into the pages).
KV_CHANNEL_SECONDS = PREFIX + "kv_channel_seconds"
DRAIN_SECONDS = PREFIX + "drain_seconds"  # histogram {release}: ack|result|timeout|not_sent
DRAINED_PAGES = PREFIX + "drained_pages"  # counter {release}
HANDOFFS_ACTIVE = PREFIX + "handoffs_active"  # gauge {state}
STAGING_PAGES = PREFIX + "staging_pages"  # gauge {state}: prefill's transfer staging
PREFILL_CAPACITY_AGE = PREFIX + "prefill_capacity_age_seconds"  # gauge: decode's view of prefill

_STEP_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_HANDOFF_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0)


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
        self.preemptions = Counter(
            PREEMPTIONS,
            "Running requests preempted (pages released, tokens recomputed)",
            registry=r,
        )
        self.prefix_cache_tokens = Counter(
            PREFIX_CACHE_TOKENS,
            "Cacheable prompt tokens at admission: read from the tenant's cache (hit) or not",
            ["result"],
            registry=r,
        )
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
        self.mode = Gauge(
            MODE, "1 for the run mode (KVGUARD_MODE) of this engine", ["mode"], registry=r
        )
        self.step_seconds = Histogram(
            STEP_SECONDS, "Engine step phases", ["phase"], buckets=_STEP_BUCKETS, registry=r
        )
        self.ttft_seconds = Histogram(
            TTFT_SECONDS, "Time to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.role = labels["role"]
        self._handoff_metrics(r)

    def _handoff_metrics(self, r: CollectorRegistry) -> None:
        self.handoffs = Counter(HANDOFFS, "Handoffs by outcome", ["outcome"], registry=r)
        self.handoff_refusals = Counter(
            HANDOFF_REFUSALS, "Handoffs refused by decode, by check", ["check"], registry=r
        )
        self.handoff_transfer_mismatch = Counter(
            HANDOFF_TRANSFER_MISMATCH, "Results whose transferred range != reserved", registry=r
        )
        self.handoff_checksum_failures = Counter(
            HANDOFF_CHECKSUM_FAILURES, "Results whose KV checksum did not match", registry=r
        )
        self.handoff_late_writes = Counter(
            HANDOFF_LATE_WRITES, "Pages written after decode had released them", registry=r
        )
        self.quarantine_absorbed_writes = Counter(
            QUARANTINE_ABSORBED_WRITES,
            "Pages an aborted handoff wrote while decode held them in quarantine",
            registry=r,
        )
        self.handoff_seconds = Histogram(
            HANDOFF_SECONDS, "Decode: request sent -> result", buckets=_HANDOFF_BUCKETS, registry=r
        )
        self.transfer_seconds = Histogram(
            TRANSFER_SECONDS, "Prefill: KV transfer time", buckets=_HANDOFF_BUCKETS, registry=r
        )
        self.checksum_seconds = Histogram(
            CHECKSUM_SECONDS, "KV checksum time", buckets=_HANDOFF_BUCKETS, registry=r
        )
        self.kv_channel_seconds = Histogram(
            KV_CHANNEL_SECONDS,
            "Sealed KV channel work per handoff, by phase",
            ["phase"],
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )
        self.drain_seconds = Histogram(
            DRAIN_SECONDS,
            "Quarantine (drain) time before pages were freed",
            ["release"],
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )
        self.drained_pages = Counter(
            DRAINED_PAGES, "Pages freed after a drain", ["release"], registry=r
        )
        self.handoffs_active = Gauge(
            HANDOFFS_ACTIVE, "Handoffs in progress by state", ["state"], registry=r
        )
        self.staging_pages = Gauge(STAGING_PAGES, "Prefill staging pages", ["state"], registry=r)
        self.prefill_capacity_age = Gauge(
            PREFILL_CAPACITY_AGE, "Age of decode's last prefill capacity report", registry=r
        )

    def track_pool(
        self,
        free: Callable[[], int],
        owned: Callable[[], int],
        quarantined: Callable[[], int],
        shared: Callable[[], int],
    ) -> None:
        self.pool_pages.labels("free").set_function(free)
        self.pool_pages.labels("owned").set_function(owned)
        self.pool_pages.labels("quarantined").set_function(quarantined)
        self.pool_pages.labels("shared").set_function(shared)
