"""KV bytes of the handoff: segments write exactly the prompt's slots; checksums agree."""

from __future__ import annotations

import ctypes

import pytest
import torch

from backend.core.pages import Owner
from backend.disagg.kvio import (
    StagingArea,
    algorithm_of,
    kv_digest,
    layout_of,
    transfer_batches,
)
from backend.disagg.protocol import KvChannel, PageGrant, TransferTarget
from backend.model.kv_cache import KVCache


def cache(pages: int, *, fill: bool) -> KVCache:
    kv = KVCache(2, pages, 4, 2, 3, torch.float32, "cpu")
    if fill:
        torch.manual_seed(pages)
        kv.k.copy_(torch.randn_like(kv.k))
        kv.v.copy_(torch.randn_like(kv.v))
    return kv


def target(kv: KVCache, max_batch_pages: int) -> TransferTarget:
    bases = (kv.k.data_ptr(), kv.v.data_ptr())
    return TransferTarget("x", "i", KvChannel.OPEN, bases, layout_of(kv), max_batch_pages)


SRC_PAGES = [0, 1, 2, 5, 6]
DST_PAGES = [7, 8, 3, 4, 9]  # coalesced runs: 0,1 -> 7,8 | 2 -> 3 | 5 -> 4 | 6 -> 9
N_TOKENS = 18  # 4 full pages + 2 tokens of the fifth


@pytest.mark.parametrize("batch_pages", [1, 2, 16])
def test_segments_copy_exactly_the_prompt_and_checksums_agree(batch_pages: int) -> None:
    src, dst = cache(8, fill=True), cache(12, fill=False)
    grants = [PageGrant(p, 1) for p in DST_PAGES]
    batches = transfer_batches(src, SRC_PAGES, target(dst, batch_pages), grants, N_TOKENS)
    assert len(batches) == -(-len(SRC_PAGES) // batch_pages)
    for batch in batches:
        for segment in batch:
            ctypes.memmove(segment.dst, segment.src, segment.length)
    assert kv_digest(src.k, src.v, SRC_PAGES, N_TOKENS) == kv_digest(
        dst.k, dst.v, DST_PAGES, N_TOKENS
    )
    for s, d in zip(SRC_PAGES[:4], DST_PAGES[:4], strict=True):
        assert torch.equal(src.k[:, s], dst.k[:, d]) and torch.equal(src.v[:, s], dst.v[:, d])
    # The last page: its 2 prompt slots arrive, the tail (someone else's old KV) does not.
    assert torch.equal(dst.k[:, 9, :2], src.k[:, 6, :2])
    assert torch.count_nonzero(dst.k[:, 9, 2:]) == 0 and torch.count_nonzero(dst.v[:, 9, 2:]) == 0
    untouched = [p for p in range(12) if p not in DST_PAGES]
    assert torch.count_nonzero(dst.k[:, untouched]) == 0


def test_consecutive_pages_coalesce_into_one_segment_per_layer_and_kind() -> None:
    src, dst = cache(8, fill=True), cache(12, fill=False)
    grants = [PageGrant(p, 1) for p in (4, 5, 6)]
    (batch,) = transfer_batches(src, [0, 1, 2], target(dst, 8), grants, 12)
    assert len(batch) == 2 * 2  # layers x (K, V)
    assert {s.length for s in batch} == {12 * 2 * 3 * 4}


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_checksum_covers_the_prompt_slots_only(algorithm: str) -> None:
    kv = cache(8, fill=True)
    before = kv_digest(kv.k, kv.v, SRC_PAGES, N_TOKENS, algorithm)
    assert before.startswith(f"{algorithm}:") and algorithm_of(before) == algorithm
    kv.k[1, 6, 3] += 1.0  # beyond the prompt: not covered
    assert kv_digest(kv.k, kv.v, SRC_PAGES, N_TOKENS, algorithm) == before
    kv.v[0, 6, 1] += 1.0  # the prompt's last token
    assert kv_digest(kv.k, kv.v, SRC_PAGES, N_TOKENS, algorithm) != before
    with pytest.raises(ValueError):
        kv_digest(kv.k, kv.v, SRC_PAGES, 21, algorithm)
    assert algorithm_of("md4:00") is None


def test_staging_area_owns_its_pages_and_zeroes_them() -> None:
    engine_kv = cache(8, fill=True)
    staging = StagingArea(cache(4, fill=False), zero_on_free=True)
    owner = Owner("r", "t")
    refs = staging.reserve(3, owner)
    assert refs is not None and staging.reserve(2, Owner("s", "t")) is None
    staging.stage(engine_kv, [5, 6, 7], refs)
    assert kv_digest(staging.kv.k, staging.kv.v, [r.page_id for r in refs], 12) == kv_digest(
        engine_kv.k, engine_kv.v, [5, 6, 7], 12
    )
    staging.release(refs, owner)
    assert staging.free_pages == 4 and torch.count_nonzero(staging.kv.k) == 0
