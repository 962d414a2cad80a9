"""The SGLang and vLLM engines behind the gateway: a dashboard from the metrics they export.

The bundled engine's handoff proof has no equivalent there; what these engines do export is their
load, KV pool use, latency and (SGLang) prefill/decode transfer queues and failures. The names
are the engines' own, read from their sources (tests/ops/fixtures/README.md has the stand-in
expositions built from the same files):
- vLLM v0.10 (V1 engine): ``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; labels
  ``model_name`` and ``engine`` (the engine-core index);
- SGLang 0.5 (main at 00ae9c15): ``python/sglang/srt/metrics/collector.py``,
  ``SchedulerMetricsCollector`` and ``TokenizerMetricsCollector``; labels ``model_name``,
  ``tp_rank``, ... The prefill/decode (PD) queue and failure gauges and counters are recent:
  older SGLang releases leave those panels empty.

Scrape every worker with ``engine`` = the name the gateway routes the deployment by and ``role``
(``dashboards.build.engine_targets``), so ``$engine`` selects the same engines as on the other
dashboards. vLLM's own ``engine`` label then shows as ``exported_engine`` (Prometheus renames a
scraped label that collides with a target label).
"""

from __future__ import annotations

from dashboards.spec import ENGINE, RI, Dashboard, Panel, _q, _quantiles, events_in

# vLLM (prometheus_client appends _total to counters; these are the exposed series names)
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens_total"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"
VLLM_REQUEST_SUCCESS = "vllm:request_success_total"  # by finished_reason
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits_total"
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_QUEUE = "vllm:request_queue_time_seconds"

# SGLang
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_QUEUED = "sglang:num_queue_reqs"
SGLANG_TOKEN_USAGE = "sglang:token_usage"
SGLANG_CACHE_HIT_RATE = "sglang:cache_hit_rate"
SGLANG_RETRACTED = "sglang:num_retracted_reqs"
SGLANG_PROMPT_TOKENS = "sglang:prompt_tokens_total"
SGLANG_GENERATION_TOKENS = "sglang:generation_tokens_total"
SGLANG_TTFT = "sglang:time_to_first_token_seconds"
SGLANG_ITL = "sglang:inter_token_latency_seconds"
SGLANG_E2E = "sglang:e2e_request_latency_seconds"
SGLANG_PREFILL_PREALLOC = "sglang:num_prefill_prealloc_queue_reqs"
SGLANG_PREFILL_INFLIGHT = "sglang:num_prefill_inflight_queue_reqs"
SGLANG_DECODE_PREALLOC = "sglang:num_decode_prealloc_queue_reqs"
SGLANG_DECODE_TRANSFER = "sglang:num_decode_transfer_queue_reqs"
SGLANG_BOOTSTRAP_FAILED = "sglang:num_bootstrap_failed_reqs_total"
SGLANG_TRANSFER_FAILED = "sglang:num_transfer_failed_reqs_total"
SGLANG_KV_TRANSFER_LATENCY_MS = "sglang:kv_transfer_latency_ms"

SEL = f"{{{ENGINE}}}"


def _by_engine(metric: str, legend: str, agg: str = "sum") -> tuple[str, str]:
    """A gauge per engine and role (``agg`` over the workers and ranks of each)."""
    return f"{agg} by (engine, role) ({metric}{SEL})", f"{legend} {{{{engine}}}} {{{{role}}}}"


def _rate(metric: str, legend: str) -> tuple[str, str]:
    return f"sum by (engine) (rate({metric}{SEL}[{RI}]))", f"{legend} {{{{engine}}}}"


PANELS = (
    Panel(
        "Requests running and waiting",
        tuple(
            _q(*_by_engine(m, legend))
            for m, legend in (
                (VLLM_RUNNING, "vLLM running"),
                (VLLM_WAITING, "vLLM waiting"),
                (SGLANG_RUNNING, "SGLang running"),
                (SGLANG_QUEUED, "SGLang queued"),
            )
        ),
    ),
    Panel(
        "KV cache in use (share of the pool)",
        (
            _q(*_by_engine(VLLM_KV_USAGE, "vLLM", "max")),
            _q(*_by_engine(SGLANG_TOKEN_USAGE, "SGLang", "max")),
        ),
        unit="percentunit",
        description="The engine's own KV pool use; the gateway admits by the pool each engine "
        "reports (Capacity truth dashboard).",
    ),
    Panel(
        "Tokens per second (prompt / generated)",
        tuple(
            _q(*_rate(m, legend))
            for m, legend in (
                (VLLM_PROMPT_TOKENS, "vLLM prompt"),
                (VLLM_GENERATION_TOKENS, "vLLM generated"),
                (SGLANG_PROMPT_TOKENS, "SGLang prompt"),
                (SGLANG_GENERATION_TOKENS, "SGLang generated"),
            )
        ),
    ),
    Panel(
        "Time to first token (engine)",
        _quantiles(VLLM_TTFT, "engine", ENGINE, "vLLM")
        + _quantiles(SGLANG_TTFT, "engine", ENGINE, "SGLang"),
        unit="s",
    ),
    Panel(
        "End-to-end request latency (engine)",
        _quantiles(VLLM_E2E, "engine", ENGINE, "vLLM")
        + _quantiles(SGLANG_E2E, "engine", ENGINE, "SGLang"),
        unit="s",
    ),
    Panel(
        "Inter-token latency (SGLang)",
        _quantiles(SGLANG_ITL, "engine", ENGINE, "SGLang"),
        unit="s",
    ),
    Panel(
        "Queue time (vLLM)",
        _quantiles(VLLM_QUEUE, "engine", ENGINE, "vLLM"),
        unit="s",
    ),
    Panel(
        "Prefix cache hit rate",
        (
            _q(
                f"sum by (engine) (rate({VLLM_PREFIX_HITS}{SEL}[{RI}])) / "
                f"sum by (engine) (rate({VLLM_PREFIX_QUERIES}{SEL}[{RI}]))",
                "vLLM {{engine}}",
            ),
            _q(f"avg by (engine) ({SGLANG_CACHE_HIT_RATE}{SEL})", "SGLang {{engine}}"),
        ),
        unit="percentunit",
        description="Shared prefix pages are a tenant-isolation surface: the gateway sets each "
        "engine's per-request cache isolation field.",
    ),
    Panel(
        "Preempted (vLLM) and retracted (SGLang) requests",
        (
            _q(*_rate(VLLM_PREEMPTIONS, "vLLM preempted/s")),
            _q(*_by_engine(SGLANG_RETRACTED, "SGLang retracted")),
        ),
    ),
    Panel(
        "Finished requests by reason (vLLM)",
        (
            _q(
                f"sum by (engine, finished_reason) (rate({VLLM_REQUEST_SUCCESS}{SEL}[{RI}]))",
                "{{engine}} {{finished_reason}}",
            ),
        ),
        unit="reqps",
    ),
    Panel(
        "Prefill/decode transfer queues (SGLang PD)",
        tuple(
            _q(*_by_engine(m, legend))
            for m, legend in (
                (SGLANG_PREFILL_PREALLOC, "prefill bootstrap"),
                (SGLANG_PREFILL_INFLIGHT, "prefill in flight"),
                (SGLANG_DECODE_PREALLOC, "decode prealloc"),
                (SGLANG_DECODE_TRANSFER, "decode transfer"),
            )
        ),
        description="Requests waiting for a KV handoff between SGLang's prefill and decode "
        "workers.",
    ),
    Panel(
        "KV handoff failures (SGLang PD)",
        tuple(
            _q(f"sum by (engine, role) ({events_in(m, RI, ENGINE)})", f"{legend} {{{{engine}}}}")
            for m, legend in (
                (SGLANG_BOOTSTRAP_FAILED, "bootstrap failed"),
                (SGLANG_TRANSFER_FAILED, "transfer failed"),
            )
        ),
        description="SGLang aborts such a request; a rising count is a transport or "
        "version-skew problem between its prefill and decode workers.",
    ),
    Panel(
        "KV transfer latency (SGLang PD)",
        (_q(*_by_engine(SGLANG_KV_TRANSFER_LATENCY_MS, "latest transfer", "max")),),
        unit="ms",
    ),
)

ENGINES = Dashboard(
    uid="kvguard-engines",
    title="kvguard / SGLang and vLLM engines",
    panels=PANELS,
)

# Every third-party series name the dashboard reads (tests hold them to the stand-in expositions).
METRIC_NAMES = frozenset(
    value for name, value in globals().items() if name.startswith(("VLLM_", "SGLANG_"))
)
