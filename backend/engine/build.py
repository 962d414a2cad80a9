"""Building a running engine from ``BackendSettings``: model, real pool, limits, loop.

Start-up order: load the checkpoint (clear error naming the file) -> size the page pool from
``pool_tokens`` or the KV memory budget -> decide the advertised window -> refuse a window larger
than the real pool unless drift is explicitly allowed (then it is reported, never hidden).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.config import BackendSettings
from backend.core.admission import CapacityLimits
from backend.core.errors import IsolationReason
from backend.core.kv_manager import Allocation
from backend.core.pages import PagePool
from backend.core.prefix_cache import CacheScopes
from backend.core.scheduler import Scheduler
from backend.engine.async_engine import AsyncEngine
from backend.engine.core import EngineCore
from backend.engine.grammar import GrammarBackend
from backend.engine.runner import ModelRunner
from backend.metrics import EngineMetrics
from backend.model.chat import ChatFormat, load_chat_renderer
from backend.model.config import ModelConfig
from backend.model.kv_cache import KVCache
from backend.model.llama import LlamaModel, compute_dtype, load_model
from backend.model.snapshot import resolve_checkpoint_dir
from backend.model.tokenizer import Tokenizer

CoreFactory = Callable[[Scheduler, ModelRunner, EngineMetrics], EngineCore]


class CapacityDriftRefused(RuntimeError):
    """The configured window exceeds the real KV pool and drift was not explicitly allowed."""


@dataclass(slots=True)
class BuiltEngine:
    engine: AsyncEngine
    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer
    limits: CapacityLimits
    pool: PagePool
    kv_cache: KVCache
    metrics: EngineMetrics
    render_chat: ChatFormat
    grammar: GrammarBackend


def pool_pages(settings: BackendSettings, config: ModelConfig, dtype: torch.dtype) -> int:
    """Pages for the configured pool: an explicit token count, or the memory budget."""
    if settings.pool_tokens is not None:
        return -(-settings.pool_tokens // settings.page_size)
    pages = KVCache.pages_for_budget(
        settings.kv_memory_bytes,
        config.num_hidden_layers,
        settings.page_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype,
    )
    if pages < 1:
        raise ValueError(f"kv_memory_bytes={settings.kv_memory_bytes} holds no KV page")
    return pages


def decide_limits(settings: BackendSettings, config: ModelConfig, pages: int) -> CapacityLimits:
    pool_tokens = pages * settings.page_size
    window = settings.context_window
    if window is None:
        window = min(config.max_positions, pool_tokens)
    limits = CapacityLimits(page_size=settings.page_size, pool_pages=pages, context_window=window)
    if limits.drift is not None and not settings.allow_capacity_drift:
        raise CapacityDriftRefused(
            f"{limits.drift}. Lower --context-window, raise the pool, or pass "
            "--allow-capacity-drift to run anyway (requests stay limited to the pool and the "
            "drift is reported)"
        )
    return limits


def build_engine(
    settings: BackendSettings,
    *,
    role: str = "unified",
    scheduler_cls: type[Scheduler] = Scheduler,
    make_core: CoreFactory | None = None,
    zero_on_free: bool | None = None,
    per_tenant_cache: bool = True,
) -> BuiltEngine:
    """Model, real pool, limits, scheduler, core and loop for one role.

    Roles with a handoff pass their scheduler class and core factory; ``zero_on_free`` overrides
    the setting (the ``no_zero_on_free`` drill turns it off), ``per_tenant_cache=False`` is the
    ``shared_prefix_across_tenants`` drill. The prefix cache's scope key is drawn here, per
    process: it never leaves the engine, so it needs no configuration.
    """
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    checkpoint = resolve_checkpoint_dir(settings.model)
    config = ModelConfig.from_dir(checkpoint)
    dtype = compute_dtype(config, settings.device, settings.dtype)
    model, config, tokenizer = load_model(checkpoint, device=settings.device, dtype=dtype)
    render_chat = load_chat_renderer(checkpoint, config)  # refuses a template that cannot render
    pages = pool_pages(settings, config, model.dtype)
    limits = decide_limits(settings, config, pages)
    zero = settings.zero_on_free if zero_on_free is None else zero_on_free
    pool = PagePool(pages, settings.page_size, zero_on_free=zero)
    kv_cache = model.new_kv_cache(pages, settings.page_size)
    scheduler = scheduler_cls(
        pool,
        limits,
        eos_token_id=tokenizer.eos_id,
        max_batch_tokens=settings.max_batch_tokens,
        max_running=settings.max_running,
        allocation=Allocation(settings.kv_allocation),
        cache_scopes=_cache_scopes(settings, role, per_tenant_cache, config),
        recompute_past=_recompute_past(config),
    )
    backend = None if settings.attention_backend == "auto" else settings.attention_backend
    metrics = EngineMetrics(role)
    grammar = GrammarBackend.for_tokenizer(tokenizer, config.vocab_size)
    runner = ModelRunner(model, kv_cache, attention_backend=backend, grammar=grammar)
    core = make_core(scheduler, runner, metrics) if make_core else EngineCore(scheduler, runner)
    core.on_isolation_error = lambda e: metrics.isolation_errors.labels(e.reason).inc()
    for reason in IsolationReason:  # exported at 0: "checked, none failed", not "no data"
        metrics.isolation_errors.labels(reason.value)
    engine = AsyncEngine(core, limits, on_step=lambda o: _observe_step(metrics, o))
    metrics.track_pool(
        lambda: pool.free_pages,
        lambda: pool.owned_pages,
        lambda: pool.quarantined_pages,
        lambda: pool.shared_pages,
    )
    return BuiltEngine(
        engine, model, config, tokenizer, limits, pool, kv_cache, metrics, render_chat, grammar
    )


def _cache_scopes(
    settings: BackendSettings, role: str, per_tenant: bool, config: ModelConfig
) -> CacheScopes | None:
    if not settings.prefix_cache or role == "decode" or _rope_by_length(config):
        # a RoPE that follows a sequence's length (dynamic, longrope) rotates the same prefix
        # differently in sequences of different lengths: a cached page would be another's KV
        return None
    groups = settings.prefix_cache_groups
    return CacheScopes.from_groups(secrets.token_bytes(32), groups, per_tenant=per_tenant)


def _rope_by_length(config: ModelConfig) -> bool:
    scaling = config.rope_scaling
    return scaling is not None and scaling.rope_type in ("dynamic", "longrope")


def _recompute_past(config: ModelConfig) -> int | None:
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type != "longrope":
        return None
    return scaling.original_max_position_embeddings


def _observe_step(metrics: EngineMetrics, outcome: object) -> None:
    from backend.engine.core import StepOutcome

    assert isinstance(outcome, StepOutcome)
    metrics.step_seconds.labels("verify").observe(outcome.verify_s)
    metrics.step_seconds.labels("forward").observe(outcome.forward_s)
    metrics.generated_tokens.inc(len(outcome.results))
    if outcome.zeroed_pages:
        metrics.zeroed_pages.inc(outcome.zeroed_pages)
    if outcome.preemptions:
        metrics.preemptions.inc(outcome.preemptions)
    if outcome.prefix_query_tokens:
        metrics.prefix_cache_tokens.labels("hit").inc(outcome.prefix_hit_tokens)
        metrics.prefix_cache_tokens.labels("miss").inc(
            outcome.prefix_query_tokens - outcome.prefix_hit_tokens
        )
