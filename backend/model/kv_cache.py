"""`KVCache`: the device memory behind the page pool, one K and one V tensor for all layers.

Layout: [layers, pages, page_size, kv_heads, head_dim]. Page `p` of layer `l` is `k[l, p]`;
token slot `s = page_id * page_size + offset`. The cache holds no ownership: which request owns
which page (and its generation) lives in the page pool; this class only moves bytes.

Lifecycle of a page's contents, driven by the runner: allocated by the pool -> `write` (each
layer, during forward) and/or `write_pages` (KV received from a prefill node) -> read by
attention through block tables -> released by the pool, optionally `zero_pages` so a later owner
can never see the previous request's K/V even if a read escaped the generation checks.

Sizing: `bytes_per_page` / `pages_for_budget` are static so a memory budget becomes a page count
before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # Zero-initialised: a page read before its first write yields zeros, never old memory.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, pages={self.num_pages}, "
            f"page_size={self.page_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def kv_bytes_per_token(self) -> int:
        """K plus V bytes of one token in one layer (what attention reads per key)."""
        return 2 * self.num_kv_heads * self.head_dim * self.k.element_size()

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K plus V bytes of one page across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    @staticmethod
    def pages_for_budget(
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        per_page = KVCache.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype)
        return max(budget_bytes, 0) // per_page

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [pages, page_size, kv_heads, head_dim] of one layer (what attention reads)."""
        return self.k[layer], self.v[layer]

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Stores k, v [T, kv_heads, head_dim] of new tokens at their slots in one layer."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, slot_mapping, k)
        self.v[layer].view(flat).index_copy_(0, slot_mapping, v)

    def zero_pages(self, page_ids: Sequence[int] | torch.Tensor) -> None:
        ids = self._ids(page_ids)
        self.k.index_fill_(1, ids, 0)
        self.v.index_fill_(1, ids, 0)

    def read_pages(
        self, page_ids: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies [layers, len(page_ids), page_size, kv_heads, head_dim] of K and V."""
        ids = self._ids(page_ids)
        return self.k.index_select(1, ids), self.v.index_select(1, ids)

    def write_pages(
        self, page_ids: Sequence[int] | torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Overwrites whole pages (e.g. KV received from a prefill node); inverse of read_pages."""
        ids = self._ids(page_ids)
        expected = (self.num_layers, len(ids), self.page_size, self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"expected K and V of shape {list(expected)}, got {list(k.shape)}")
        self.k.index_copy_(1, ids, k.to(self.dtype))
        self.v.index_copy_(1, ids, v.to(self.dtype))

    def _ids(self, page_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(page_ids, dtype=torch.int64).to(self.device)
        if ids.dim() != 1:
            raise ValueError("page ids must be a flat sequence")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_pages):
            raise ValueError(f"page ids must be in [0, {self.num_pages})")
        return ids
