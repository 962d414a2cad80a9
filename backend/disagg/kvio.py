"""KV bytes of the handoff: layouts, checksums, fingerprints, staging, and the open channel's
segments (the sealed channel's are ``backend.disagg.channel``'s).

Everything here touches tensors; the decisions about them live in ``machines`` and the role
modules. The checksum is defined over the prompt's token slots only -- for every layer, K then V,
positions ``[0, n)`` in page-table order -- so prefill (over what it staged) and decode (over what
it would serve: the opened pages, or on the open channel its reserved pages) hash exactly the same
bytes, and a page tail beyond the prompt (which may hold anyone's old KV) is never hashed.
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from collections.abc import Sequence
from typing import Protocol

import torch

from backend.core.pages import Owner, PagePool, PageRef
from backend.disagg.protocol import KvLayout, PageGrant, TransferTarget
from backend.model.kv_cache import KVCache
from backend.transport.base import Segment

CHECKSUM_ALGORITHMS = ("crc32", "sha256")
DEFAULT_CHECKSUM = "crc32"

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def layout_of(kv: KVCache) -> KvLayout:
    return KvLayout(
        num_layers=kv.num_layers,
        num_pages=kv.num_pages,
        page_size=kv.page_size,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        dtype=_DTYPE_NAMES[kv.dtype],
    )


def _bytes(tensor: torch.Tensor) -> memoryview:
    # numpy has no bfloat16: hash the raw bytes of a contiguous tensor instead.
    return tensor.contiguous().view(torch.uint8).numpy().data


def runs(page_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start index, first page id, length) of each run of consecutive page ids, in order."""
    found: list[tuple[int, int, int]] = []
    for index, page_id in enumerate(page_ids):
        if found and found[-1][1] + found[-1][2] == page_id:
            start, first, length = found[-1]
            found[-1] = (start, first, length + 1)
        else:
            found.append((index, page_id, 1))
    return found


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class _Digest(Protocol):
    def update(self, data: memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def algorithm_of(checksum: str) -> str | None:
    """The algorithm a checksum string names (``crc32:...``), if it is one this node knows."""
    name = checksum.partition(":")[0]
    return name if name in CHECKSUM_ALGORITHMS else None


def kv_digest(
    k: torch.Tensor,
    v: torch.Tensor,
    page_ids: Sequence[int],
    n_tokens: int,
    algorithm: str = DEFAULT_CHECKSUM,
) -> str:
    """Checksum of positions ``[0, n_tokens)`` held in ``page_ids`` (in order), all layers, of K
    and V ``[layers, pages, page_size, kv_heads, head_dim]`` (a pool, staging, or opened pages).

    Hashes runs of consecutive pages in place (no copy of a contiguous pool): the byte stream is K
    then V, layer by layer, token by token, whatever the page ids are. ``crc32`` (zlib) is the
    default: the check is against stale, partial or damaged transfers, not an adversary (the seal
    is that), and it is 2-3x faster than ``sha256`` on CPU; the name travels with the value so the
    receiver recomputes the same one.
    """
    num_layers, _, page_size, heads, head_dim = k.shape
    if n_tokens > len(page_ids) * page_size:
        raise ValueError(f"{n_tokens} tokens do not fit in {len(page_ids)} pages")
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    h: _Digest = _Crc32() if algorithm == "crc32" else hashlib.sha256()
    found = runs(page_ids)
    for cache in (k, v):
        for layer in range(num_layers):
            for start, first, length in found:
                tokens = min(length * page_size, n_tokens - start * page_size)
                if tokens <= 0:
                    break
                block = cache[layer, first : first + length].reshape(-1, heads, head_dim)
                h.update(_bytes(block[:tokens]))
    return f"{algorithm}:{h.hexdigest()[:32]}"


def page_fingerprints(kv: KVCache, page_ids: Sequence[int], n_tokens: int) -> list[str]:
    """A short content hash per page of the slots holding positions ``[0, n_tokens)``.

    For drills and tests: what a request's prompt pages held, without the slots its own decode
    writes later. All layers, K and V.
    """
    out: list[str] = []
    for index, page_id in enumerate(page_ids):
        slots = max(0, min(kv.page_size, n_tokens - index * kv.page_size))
        h = hashlib.sha256()
        h.update(_bytes(kv.k[:, page_id, :slots]))
        h.update(_bytes(kv.v[:, page_id, :slots]))
        out.append(h.hexdigest()[:16])
    return out


def transfer_batches(
    source: KVCache,
    source_pages: Sequence[int],
    target: TransferTarget,
    grants: Sequence[PageGrant],
    n_tokens: int,
) -> list[list[Segment]]:
    """The open channel: segments writing prompt positions ``[0, n_tokens)`` from
    ``source_pages`` straight into the granted pages of decode's pools (``target.bases``: K, V).

    Grouped into batches of at most ``target.max_batch_pages`` pages (every layer, K and V of a
    page travel in the same batch), in page order. Only the prompt's token slots are written.
    Pages consecutive on both sides become one segment per layer and K/V (per-segment overhead
    dominates a TCP transfer of small pages).
    """
    src_layout, dst_layout = layout_of(source), target.layout
    if not src_layout.same_geometry(dst_layout):
        raise ValueError(f"KV layouts differ: {src_layout} vs {dst_layout}")
    if len(source_pages) != len(grants):
        raise ValueError("source and destination page counts differ")
    page_size = src_layout.page_size
    used = -(-n_tokens // page_size)
    pages = [(source_pages[i], grants[i].page_id) for i in range(used)]
    batches: list[list[Segment]] = []
    for first in range(0, used, target.max_batch_pages):
        chunk = pages[first : first + target.max_batch_pages]
        batches.append(_segments(source, target, chunk, first, n_tokens))
    return batches


def _segments(
    source: KVCache,
    target: TransferTarget,
    chunk: list[tuple[int, int]],
    first: int,
    n_tokens: int,
) -> list[Segment]:
    src_layout, dst_layout = layout_of(source), target.layout
    page_size, token_bytes = src_layout.page_size, src_layout.token_bytes
    both: list[tuple[int, int, int]] = []  # (src page, dst page, pages), consecutive on both
    for src, dst in chunk:
        if both and both[-1][0] + both[-1][2] == src and both[-1][1] + both[-1][2] == dst:
            both[-1] = (both[-1][0], both[-1][1], both[-1][2] + 1)
        else:
            both.append((src, dst, 1))
    k_base, v_base = target.bases
    bases = ((source.k.data_ptr(), k_base), (source.v.data_ptr(), v_base))
    segments: list[Segment] = []
    start = first
    for src, dst, length in both:
        tokens = min(length * page_size, n_tokens - start * page_size)
        for layer in range(src_layout.num_layers):
            src_off, dst_off = src_layout.offset(layer, src), dst_layout.offset(layer, dst)
            for src_base, dst_base in bases:
                segments.append(
                    Segment(src_base + src_off, dst_base + dst_off, tokens * token_bytes)
                )
        start += length
    return segments


class StagingArea:
    """Prefill's transfer source: prompt KV copied out of the engine's pages, held until the
    transfer finished or was cancelled, so the engine can reuse its own pages at once.

    Ownership of staging pages is a ``PagePool`` of its own (same rules: generations, zeroing).
    ``reserve``/``release`` are called from the event loop, ``stage`` from the engine thread,
    reads from transfer threads; the lock guards the pool's books only.
    """

    def __init__(self, kv: KVCache, *, zero_on_free: bool) -> None:
        self.kv = kv
        self._pool = PagePool(kv.num_pages, kv.page_size, zero_on_free=zero_on_free)
        self._lock = threading.Lock()

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    @property
    def free_pages(self) -> int:
        with self._lock:
            return self._pool.free_pages

    def reserve(self, n_pages: int, owner: Owner) -> tuple[PageRef, ...] | None:
        with self._lock:
            if n_pages > self._pool.free_pages:
                return None
            return tuple(self._pool.allocate(n_pages, owner))

    def release(self, refs: Sequence[PageRef], owner: Owner) -> None:
        with self._lock:
            to_zero = self._pool.free(refs, owner)
            if to_zero:
                self.kv.zero_pages(to_zero)
                self._pool.confirm_zeroed(to_zero)

    def stage(self, source: KVCache, source_pages: Sequence[int], refs: Sequence[PageRef]) -> None:
        """Copy whole pages from the engine's cache (read while the engine still owns them)."""
        k, v = source.read_pages(list(source_pages))
        self.kv.write_pages([ref.page_id for ref in refs], k, v)
