"""Paged attention over a KV cache laid out as [pages, page_size, kv_heads, head_dim] per layer.

One call serves a flattened ragged batch (see `AttentionMetadata`): decode tokens and prefill
chunks of many sequences together. Each query token attends causally to its own chunk and fully
to the sequence's earlier context, reading K/V only through the sequence's block table. With a
sliding `window` (Mistral), a query at position p sees only keys p - window + 1 .. p.

Two implementations, tested against each other:
- `"torch"`, the reference (the CPU default) in `backend.kernels.torch_paged`: gathers keys by
  slot and runs batched, masked SDPA calls (decodes together, prefill chunks together or apart).
- `"triton"` (the default on CUDA): kernels in `backend.kernels.triton_paged` that read K/V
  through the block table on the device. Imported lazily, so CPU runs never import Triton.
"""

from __future__ import annotations

from typing import Literal

import torch

from backend.kernels.metadata import AttentionMetadata
from backend.kernels.torch_paged import AttentionPlan, plan_attention, torch_paged_attention

Backend = Literal["torch", "triton"]


def default_backend(device: torch.device) -> Backend:
    return "triton" if device.type == "cuda" else "torch"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    backend: Backend | None = None,
    plan: AttentionPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D], caches [pages, page_size, kv_heads, D] -> attention output [T, H, D].

    `plan` (from `plan_attention(metadata, window=window)`) lets a caller prepare the reference
    path once per step instead of once per layer; the Triton path needs none.
    """
    _check_shapes(q, k_cache, v_cache, metadata)
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    chosen = backend or default_backend(q.device)
    if chosen == "triton":
        from backend.kernels.triton_paged import triton_paged_attention

        return triton_paged_attention(q, k_cache, v_cache, metadata, scale, window)
    if chosen == "torch":
        plan = plan or plan_attention(metadata, window=window)
        if plan.window != window:
            raise ValueError(f"the plan is for window {plan.window}, the call for {window}")
        return torch_paged_attention(q, k_cache, v_cache, plan, scale)
    raise ValueError(f"unknown attention backend {chosen!r}")


def _check_shapes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, H, D] and caches [pages, page_size, kv_heads, D], got "
            f"{list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}"
        )
    if q.shape[0] != md.num_tokens or k_cache.shape[1] != md.page_size:
        raise ValueError(
            f"q has {q.shape[0]} tokens and pages hold {k_cache.shape[1]}; metadata says "
            f"{md.num_tokens} tokens and page_size {md.page_size}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads/dim {list(q.shape[1:])} do not fit KV {list(k_cache.shape[2:])}")
