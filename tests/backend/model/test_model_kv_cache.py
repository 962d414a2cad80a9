"""KVCache: sizing before allocation, slot writes, zeroing and whole-page copies."""

from __future__ import annotations

import pytest
import torch

from backend.model.kv_cache import KVCache


def test_bytes_per_page_and_budget_are_known_before_allocation():
    # 2 (K and V) * 4 layers * 16 tokens * 2 heads * 64 dims * 2 bytes
    assert KVCache.bytes_per_page(4, 16, 2, 64, torch.bfloat16) == 32768
    assert KVCache.bytes_per_page(4, 16, 2, 64, torch.float32) == 65536
    assert KVCache.pages_for_budget(1_000_000, 4, 16, 2, 64, torch.bfloat16) == 30
    assert KVCache.pages_for_budget(-5, 4, 16, 2, 64, torch.bfloat16) == 0
    cache = KVCache(4, 30, 16, 2, 64, torch.bfloat16, "cpu")
    allocated = cache.k.numel() * 2 + cache.v.numel() * 2
    assert allocated == 30 * KVCache.bytes_per_page(4, 16, 2, 64, torch.bfloat16)


def test_write_puts_each_token_at_page_times_size_plus_offset():
    cache = KVCache(2, 4, 3, 1, 2, torch.float32, "cpu")
    k = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]]])
    slots = torch.tensor([2 * 3 + 1, 0 * 3 + 2])  # page 2 offset 1, page 0 offset 2

    cache.write(1, slots, k, -k)

    k_pages, v_pages = cache.read_pages([2, 0])
    assert k_pages[1, 0, 1].tolist() == [[1.0, 1.0]]
    assert k_pages[1, 1, 2].tolist() == [[2.0, 2.0]]
    assert v_pages[1, 0, 1].tolist() == [[-1.0, -1.0]]
    assert k_pages.abs().sum() == 6.0  # nothing else written, layer 0 untouched
    assert cache.k[0].abs().sum() == 0


def test_zero_pages_clears_only_those_pages_in_every_layer():
    cache = KVCache(2, 4, 2, 1, 2, torch.float32, "cpu")
    cache.k.fill_(1.0)
    cache.v.fill_(1.0)

    cache.zero_pages([1, 3])

    assert cache.k[:, [1, 3]].abs().sum() == 0 and cache.v[:, [1, 3]].abs().sum() == 0
    assert bool((cache.k[:, [0, 2]] == 1).all()) and bool((cache.v[:, [0, 2]] == 1).all())


def test_write_pages_is_the_inverse_of_read_pages():
    src = KVCache(2, 5, 2, 2, 4, torch.float32, "cpu")
    src.k.normal_()
    src.v.normal_()
    dst = KVCache(2, 5, 2, 2, 4, torch.bfloat16, "cpu")
    k, v = src.read_pages([4, 1])

    dst.write_pages([0, 2], k, v)

    torch.testing.assert_close(dst.k[:, [0, 2]], src.k[:, [4, 1]].to(torch.bfloat16))
    torch.testing.assert_close(dst.v[:, [0, 2]], src.v[:, [4, 1]].to(torch.bfloat16))
    assert dst.k[:, [1, 3, 4]].abs().sum() == 0


def test_page_ids_and_shapes_are_checked():
    cache = KVCache(1, 3, 2, 1, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        cache.zero_pages([3])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        cache.read_pages([-1])
    with pytest.raises(ValueError, match="expected K and V of shape"):
        cache.write_pages([0], torch.zeros(1, 2, 2, 1, 2), torch.zeros(1, 2, 2, 1, 2))
    with pytest.raises(ValueError, match="num_pages must be positive"):
        KVCache(1, 0, 2, 1, 2, torch.float32, "cpu")
    assert "pages=3" in repr(cache)
