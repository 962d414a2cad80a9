"""vLLM: ``GET /v1/models`` for ``max_model_len``, ``GET /metrics`` for the real KV pool.

vLLM publishes its cache configuration as an info gauge, one sample per engine core::

    vllm:cache_config_info{block_size="16",num_gpu_blocks="573",...,engine="0"} 1.0

The pool is ``num_gpu_blocks * block_size`` (the smallest over engine cores). A missing gauge or
a ``"None"`` label (not yet profiled) leaves the pool unknown, so the engine is not routed to.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.adapters.base import (
    AdapterError,
    EngineAdapter,
    get_json,
    get_response,
    positive_int,
)
from gateway.engines.capacity import CapacitySnapshot, RoleView

CACHE_INFO = "vllm:cache_config_info"


class VLLMAdapter(EngineAdapter):
    async def introspect(self, client: httpx.AsyncClient, *, timeout: float) -> CapacitySnapshot:
        models = await get_json(
            client, self.url("/v1/models"), timeout=timeout, headers=self.headers()
        )
        metrics = await get_response(
            client, self.url("/metrics"), timeout=timeout, headers=self.headers()
        )
        return snapshot_from_vllm(models, metrics.text, wanted=self.spec.model)


def snapshot_from_vllm(
    models: dict[str, Any], metrics_text: str, *, wanted: str | None
) -> CapacitySnapshot:
    card = _model_card(models, wanted)
    window = positive_int(card, "max_model_len", where="vllm /v1/models")
    pool, block_size = _pool_from_metrics(metrics_text)
    return CapacitySnapshot(
        model=str(card["id"]),
        context_window=window,
        roles=(RoleView(role="unified", pool_tokens=pool, page_size=block_size),),
        measured=True,
    )


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


def _pool_from_metrics(text: str) -> tuple[int | None, int | None]:
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise AdapterError("vllm /metrics is not Prometheus text") from exc
    pools: list[int] = []
    block_sizes: list[int] = []
    for family in families:
        for sample in family.samples:
            if sample.name != CACHE_INFO:
                continue
            blocks = _label_int(sample.labels, "num_gpu_blocks")
            block_size = _label_int(sample.labels, "block_size")
            if blocks is None or block_size is None:
                return None, block_size  # one unprofiled core: the pool is unknown
            pools.append(blocks * block_size)
            block_sizes.append(block_size)
    if not pools:
        return None, None
    return min(pools), min(block_sizes)


def _label_int(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None or not raw.isdigit() or int(raw) <= 0:
        return None
    return int(raw)
