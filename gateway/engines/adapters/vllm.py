"""vLLM: ``GET /v1/models`` (``max_model_len``), ``GET /metrics`` (the KV pool), ``GET /version``.

Checked against vLLM 0.33.0's sources (the released wheel). The cache configuration is an info
gauge with one sample per engine core (``v1/metrics/loggers.py``, ``log_metrics_info``), whose
labels are ``CacheConfig``'s fields::

    vllm:cache_config_info{block_size="16",num_gpu_blocks="573",kv_cache_size_tokens="9168",...,
                           engine="0"} 1.0

``kv_cache_size_tokens`` (vllm-project/vllm#42206, May 2026) is the per-engine pool, group-aware
(``num_gpu_blocks * block_size`` is wrong for hybrid models); it is used when present. Without it
``num_gpu_blocks * block_size`` is used for a single engine core only: with data parallelism the
front end sums every core's ``num_gpu_blocks`` (``v1/engine/core_client.py``), so the per-core
pool cannot be read and the engine is refused with the fix.

A 404 on ``/v1/models`` or ``/metrics`` of an engine registered alone means the URL is no vLLM
server but a router (the PD proxy demo serves neither): the refusal says to list the workers as
members or to set ``discover_members``. No gauge at all means the stat loggers are off
(``--disable-log-stats``: ``AsyncLLM`` builds none) or the URL is a router that publishes its own
metrics (production-stack, llm-d): the refusal says to re-enable stats or to register the
workers as group members. An operator may instead declare the pool (``declared_pool_tokens``);
it is accepted only when it is at least the worker's ``max_model_len``, since vLLM refuses to
start when one ``max_model_len`` request cannot fit its KV cache
(``v1/core/kv_cache_planning.py``, ``_check_enough_kv_cache_memory``).

Prefix-cache isolation: ``cache_salt`` (vLLM >= 0.9.0, CVE-2025-46570) salts the prefix-cache
block hashes; 0.33.0 accepts at most 128 characters without ``@ / \\`` or NUL.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines import prompt
from gateway.engines.adapters.base import (
    AdapterError,
    get_json,
    get_response,
    parse_version,
    positive_int,
)
from gateway.engines.adapters.group import GroupAdapter, Worker
from gateway.engines.capacity import CacheIsolation, CapacitySnapshot, RoleView
from gateway.engines.spec import MemberRole

CACHE_INFO = "vllm:cache_config_info"
SALT_FROM = (0, 9, 0)
NO_STATS = (
    "/metrics has no vllm:cache_config_info: start vLLM without --disable-log-stats, or (behind "
    "a router) list the vLLM workers as members, or set declared_pool_tokens"
)

# Every vLLM API server serves /v1/models and /metrics; its PD proxy demo serves neither.
NOT_A_SERVER = (
    "a vLLM server always serves /v1/models and /metrics, so this URL looks like a router (such "
    "as vLLM's PD proxy): list the vLLM workers as members (the router stays base_url), or set "
    "discover_members = true to read them from the router"
)


class VLLMAdapter(GroupAdapter):
    tokenize_paths = ("/tokenize", "/v1/tokenize")

    def tokenize_request(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        return prompt.for_vllm(model, body)

    async def listed_workers(
        self, client: httpx.AsyncClient, *, timeout: float
    ) -> list[tuple[str, MemberRole]]:
        """vLLM's PD proxy demo: ``GET /status`` lists ``prefill_nodes``/``decode_nodes``."""
        data = await get_json(client, self.url("/status"), timeout=timeout, headers=self.headers())
        listed = []
        for role in (MemberRole.PREFILL, MemberRole.DECODE):
            nodes = data.get(f"{role.value}_nodes")
            if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
                raise AdapterError(f"vllm proxy /status: no {role.value}_nodes list")
            listed += [(n if "://" in n else f"http://{n}", role) for n in nodes]
        return listed

    async def read_worker(
        self, client: httpx.AsyncClient, worker: Worker, *, timeout: float
    ) -> CapacitySnapshot:
        base, headers = worker.url, worker.headers
        try:
            models = await get_json(client, f"{base}/v1/models", timeout=timeout, headers=headers)
            metrics = await get_response(
                client, f"{base}/metrics", timeout=timeout, headers=headers
            )
        except AdapterError as exc:
            if worker.member is None and "HTTP 404" in str(exc):
                raise AdapterError(f"{exc}: {NOT_A_SERVER}") from exc
            raise
        version = await _version(client, base, timeout=timeout, headers=headers)
        return snapshot_from_vllm(
            models,
            metrics.text,
            wanted=self.spec.model,
            version=version,
            declared_pool=worker.declared_pool_tokens,
        )


async def _version(
    client: httpx.AsyncClient, base: str, *, timeout: float, headers: dict[str, str]
) -> str | None:
    try:
        data = await get_json(client, f"{base}/version", timeout=timeout, headers=headers)
    except AdapterError:
        return None  # isolation is then reported unknown, capacity is unaffected
    version = data.get("version")
    return version if isinstance(version, str) else None


def snapshot_from_vllm(
    models: dict[str, Any],
    metrics_text: str,
    *,
    wanted: str | None,
    version: str | None = None,
    declared_pool: int | None = None,
) -> CapacitySnapshot:
    card = _model_card(models, wanted)
    window = positive_int(card, "max_model_len", where="vllm /v1/models")
    role = _pool_role(metrics_text, window=window, declared_pool=declared_pool)
    return CapacitySnapshot(
        model=str(card["id"]),
        context_window=window,
        roles=(role,),
        measured=True,
        isolation=isolation(version),
        version=version,
    )


def isolation(version: str | None) -> CacheIsolation:
    parsed = parse_version(version)
    if parsed is None or parsed < SALT_FROM:
        return CacheIsolation(
            field=None,
            detail=f"vLLM {version or 'of unknown version (GET /version failed)'}: cache_salt "
            f"is honoured from {'.'.join(map(str, SALT_FROM))}",
        )
    return CacheIsolation(field="cache_salt", detail=f"vLLM {version}: prefix cache salted")


def _pool_role(text: str, *, window: int, declared_pool: int | None) -> RoleView:
    pool, block_size, reason = pool_from_metrics(text)
    if pool is not None or declared_pool is None:
        return RoleView(
            role="unified", pool_tokens=pool, page_size=block_size, unknown_reason=reason
        )
    if declared_pool < window:
        return RoleView(
            role="unified",
            pool_tokens=None,
            unknown_reason=f"declared_pool_tokens {declared_pool} is below the worker's "
            f"max_model_len {window}, which vLLM guarantees its pool holds: fix the declaration",
        )
    return RoleView(role="unified", pool_tokens=declared_pool, pool_declared=True)


def _model_card(models: dict[str, Any], wanted: str | None) -> dict[str, Any]:
    cards = [card for card in models.get("data") or [] if isinstance(card, dict) and "id" in card]
    if wanted is not None:
        cards = [card for card in cards if card["id"] == wanted]
        if not cards:
            raise AdapterError(f"vllm /v1/models does not list the configured model '{wanted}'")
    # LoRA adapters are listed with a parent; the base model is the one without.
    base = [card for card in cards if not card.get("parent")]
    if not base:
        raise AdapterError("vllm /v1/models lists no base model")
    return base[0]


def pool_from_metrics(text: str) -> tuple[int | None, int | None, str | None]:
    """(pool tokens, block size, why the pool is unknown) from vLLM's Prometheus text."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise AdapterError("vllm /metrics is not Prometheus text") from exc
    samples = [
        sample.labels
        for family in families
        for sample in family.samples
        if sample.name == CACHE_INFO
    ]
    if not samples:
        return None, None, NO_STATS
    block_sizes = [size for labels in samples if (size := _label_int(labels, "block_size"))]
    block_size = min(block_sizes) if block_sizes else None
    sized = [_label_int(labels, "kv_cache_size_tokens") for labels in samples]
    if all(size is not None for size in sized):
        return min(size for size in sized if size is not None), block_size, None
    if len(samples) > 1:
        return (
            None,
            block_size,
            (
                f"{len(samples)} engine cores share one summed num_gpu_blocks and no "
                "kv_cache_size_tokens: upgrade vLLM (kv_cache_size_tokens, 2026-05) or register "
                "each data-parallel rank's API server as a member"
            ),
        )
    blocks = _label_int(samples[0], "num_gpu_blocks")
    if blocks is None or block_size is None:
        return None, block_size, "vllm:cache_config_info: KV cache not profiled yet"
    return blocks * block_size, block_size, None


def _label_int(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None or not raw.isdigit() or int(raw) <= 0:
        return None
    return int(raw)
