"""The PyTorch reference paged attention and AttentionMetadata.build, against a naive model.

The naive model reads each key token by token through the block table, in float64, with
explicit loops, so it shares no gather, masking or GQA code with the implementation under test.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from backend.kernels.metadata import AttentionMetadata
from backend.kernels.paged_attention import default_backend, paged_attention
from backend.kernels.torch_paged import plan_attention


def scattered_tables(
    kv_lens: list[int], page_size: int, num_pages: int, seed: int
) -> list[list[int]]:
    ids = list(range(num_pages))
    random.Random(seed).shuffle(ids)
    tables, used = [], 0
    for kv_len in kv_lens:
        n = -(-kv_len // page_size)
        tables.append(ids[used : used + n])
        used += n
    return tables


def naive_attention(
    q, k_cache, v_cache, query_lens, kv_lens, tables, page_size, scale, window=None
):
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.zeros_like(q, dtype=torch.float64)
    token = 0
    for q_len, kv_len, table in zip(query_lens, kv_lens, tables, strict=True):
        for j in range(q_len):
            pos = kv_len - q_len + j
            seen = range(0 if window is None else max(0, pos - window + 1), pos + 1)
            for h in range(heads):
                keys = [k_cache[table[t // page_size], t % page_size, h // group] for t in seen]
                vals = [v_cache[table[t // page_size], t % page_size, h // group] for t in seen]
                scores = torch.stack(keys).double() @ q[token, h].double() * scale
                out[token, h] = torch.softmax(scores, 0) @ torch.stack(vals).double()
            token += 1
    return out


def random_case(query_lens, kv_lens):
    """Random q and caches (4-token pages, 6 query heads on 2 KV heads of 8) on scattered pages."""
    torch.manual_seed(0)
    page_size, num_pages, heads, kv_heads, head_dim = 4, 32, 6, 2, 8
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim)
    tables = scattered_tables(kv_lens, page_size, num_pages, seed=1)
    md = AttentionMetadata.build(
        query_lens=query_lens, kv_lens=kv_lens, block_tables=tables, page_size=page_size
    )
    q = torch.randn(sum(query_lens), heads, head_dim)
    return q, k_cache, v_cache, md, tables


@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "groups"),
    [
        ([1, 1, 1], [1, 9, 30], 1),  # decodes only, one of them at position 0
        ([7], [7], 1),  # a whole prompt in one chunk (SDPA's own causal mask, no explicit one)
        ([5, 5], [5, 5], 1),  # fresh prompts of one length: one causal group
        ([1, 1], [9, 9], 1),  # decodes of one length: no mask at all
        # a chunk after context and a fresh prompt, padded into one group, plus the decodes
        ([5, 1, 12, 1], [13, 4, 12, 27], 2),
        # lengths too uneven to pad: each chunk is its own group
        ([2, 2, 30], [2, 9, 30], 3),
    ],
)
def test_reference_matches_naive_on_scattered_pages(query_lens, kv_lens, groups):
    q, k_cache, v_cache, md, tables = random_case(query_lens, kv_lens)
    page_size, head_dim = md.page_size, q.shape[2]
    scale = 1 / math.sqrt(head_dim)
    assert len(plan_attention(md).groups) == groups

    got = paged_attention(q, k_cache, v_cache, md, scale, backend="torch")

    want = naive_attention(q, k_cache, v_cache, query_lens, kv_lens, tables, page_size, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "window"),
    [
        ([1, 1, 1], [1, 9, 30], 4),  # decodes: each gathers only its last 4 keys
        ([7], [7], 3),  # a fresh prompt longer than the window: causal and windowed
        ([5, 1, 12, 1], [13, 4, 12, 27], 5),  # chunks after context, mixed with decodes
        ([2, 3], [2, 3], 8),  # a window longer than every sequence changes nothing
    ],
)
def test_reference_with_a_sliding_window_matches_naive(query_lens, kv_lens, window):
    q, k_cache, v_cache, md, tables = random_case(query_lens, kv_lens)
    page_size = md.page_size
    plan = plan_attention(md, window=window)
    # only the keys the earliest query row can see are gathered
    assert max(g.slots.shape[1] for g in plan.groups) <= min(
        max(kv_lens), max(query_lens) + window - 1
    )

    got = paged_attention(q, k_cache, v_cache, md, 0.3, backend="torch", plan=plan, window=window)

    want = naive_attention(q, k_cache, v_cache, query_lens, kv_lens, tables, page_size, 0.3, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    full = naive_attention(q, k_cache, v_cache, query_lens, kv_lens, tables, page_size, 0.3)
    if max(kv_lens) > window:  # negative control: the window really changed the answer
        assert (got.double() - full).abs().max() > 1e-2


def test_a_plan_for_another_window_is_refused():
    md = AttentionMetadata.build(query_lens=[1], kv_lens=[9], block_tables=[[0, 1, 2]], page_size=4)
    cache = torch.zeros(4, 4, 1, 8)
    with pytest.raises(ValueError, match="window"):
        paged_attention(torch.zeros(1, 2, 8), cache, cache, md, 1.0, "torch", plan_attention(md), 4)


def test_reference_never_reads_past_kv_len():
    """NaN in every slot past each sequence's length (and in padded entries) changes nothing."""
    torch.manual_seed(0)
    page_size, num_pages = 4, 12
    k_cache = torch.randn(num_pages, page_size, 1, 8)
    v_cache = torch.randn(num_pages, page_size, 1, 8)
    kv_lens, query_lens = [5, 1, 10], [1, 1, 3]
    tables = scattered_tables(kv_lens, page_size, num_pages, seed=2)
    md = AttentionMetadata.build(
        query_lens=query_lens, kv_lens=kv_lens, block_tables=tables, page_size=page_size
    )
    q = torch.randn(5, 2, 8)
    before = paged_attention(q, k_cache, v_cache, md, 0.3, backend="torch")
    used = {
        (p, t % page_size)
        for kv, tb in zip(kv_lens, tables, strict=True)
        for t in range(kv)
        for p in [tb[t // page_size]]
    }
    for p in range(num_pages):
        for s in range(page_size):
            if (p, s) not in used:
                k_cache[p, s] = float("nan")
                v_cache[p, s] = float("nan")

    after = paged_attention(q, k_cache, v_cache, md, 0.3, backend="torch")

    torch.testing.assert_close(after, before)


def test_build_derives_offsets_positions_and_slots():
    md = AttentionMetadata.build(
        query_lens=[2, 1], kv_lens=[5, 3], block_tables=[[7, 2], [4]], page_size=4
    )
    assert md.cu_seqlens_q.tolist() == [0, 2, 3]
    assert md.kv_lens.tolist() == [5, 3]
    assert md.block_tables.tolist() == [[7, 2], [4, 0]]
    assert md.positions().tolist() == [3, 4, 2]
    # position 3 -> page 7 offset 3; position 4 -> page 2 offset 0; position 2 -> page 4 offset 2
    assert md.slot_mapping.tolist() == [31, 8, 18]
    assert md.last_token_indices().tolist() == [1, 2]
    assert (md.num_seqs, md.num_tokens, md.max_query_len, md.max_kv_len) == (2, 3, 2, 5)


@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "tables", "num_pages", "message"),
    [
        ([3], [2], [[0]], None, "query_len"),
        ([0], [2], [[0]], None, "query_len"),
        ([1], [9], [[0, 1]], None, "need 3 pages"),
        ([1], [4], [[5]], 4, "outside the pool"),
        ([1, 1], [1], [[0]], None, "one entry per sequence"),
    ],
)
def test_build_refuses_inconsistent_plans(query_lens, kv_lens, tables, num_pages, message):
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(
            query_lens=query_lens,
            kv_lens=kv_lens,
            block_tables=tables,
            page_size=4,
            num_pages=num_pages,
        )


def test_attention_refuses_mismatched_shapes():
    md = AttentionMetadata.build(query_lens=[2], kv_lens=[2], block_tables=[[0]], page_size=4)
    cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="tokens"):
        paged_attention(torch.zeros(3, 4, 8), cache, cache, md, 1.0, backend="torch")
    with pytest.raises(ValueError, match="do not fit"):
        paged_attention(torch.zeros(2, 3, 8), cache, cache, md, 1.0, backend="torch")


def test_backend_defaults_to_triton_on_cuda_and_torch_elsewhere():
    assert default_backend(torch.device("cuda", 0)) == "triton"
    assert default_backend(torch.device("cpu")) == "torch"
    md = AttentionMetadata.build(query_lens=[1], kv_lens=[1], block_tables=[[0]], page_size=4)
    cache = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="unknown attention backend"):
        paged_attention(torch.zeros(1, 1, 8), cache, cache, md, 1.0, backend="cuda")


def test_decodes_of_very_different_lengths_split_into_groups_and_keep_token_order():
    """With kv_bytes_per_token, decodes are grouped by length (no padding 3 keys to 200); the
    output still lands on each token's own row."""
    torch.manual_seed(0)
    page_size, num_pages, heads, kv_heads, head_dim = 4, 128, 4, 2, 8
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim)
    kv_lens = [3, 200, 5, 190]
    tables = scattered_tables(kv_lens, page_size, num_pages, seed=3)
    md = AttentionMetadata.build(
        query_lens=[1] * 4, kv_lens=kv_lens, block_tables=tables, page_size=page_size
    )
    q = torch.randn(4, heads, head_dim)
    # a group costs 1 MiB / 64 KiB = 16 padded keys here, so splitting saves work
    plan = plan_attention(md, kv_bytes_per_token=1 << 16)
    assert sorted(tuple(g.slots.shape) for g in plan.groups) == [(2, 5), (2, 200)]
    assert plan_attention(md).groups[0].slots.shape == (4, 200)  # without it: one group

    got = paged_attention(q, k_cache, v_cache, md, 0.3, backend="torch", plan=plan)

    want = naive_attention(q, k_cache, v_cache, [1] * 4, kv_lens, tables, page_size, 0.3)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_grouping_is_optimal_for_its_cost_model():
    """Lengths 100, 99, 98, 10, 9: two groups ({100, 99, 98}, {10, 9}) beat one or three."""
    kv_lens = [10, 100, 9, 99, 98]
    tables = [list(range(i * 25, i * 25 + 25)) for i in range(5)]
    md = AttentionMetadata.build(
        query_lens=[1] * 5, kv_lens=kv_lens, block_tables=tables, page_size=4
    )
    plan = plan_attention(md, kv_bytes_per_token=(1 << 20) // 50)  # a group costs 50 padded keys
    assert [tuple(g.slots.shape) for g in plan.groups] == [(3, 100), (2, 10)]
    assert [g.tokens.flatten().tolist() for g in plan.groups] == [[1, 3, 4], [0, 2]]


@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "masked", "causal"),
    [
        ([7, 7], [7, 7], False, True),  # fresh prompts of one length
        ([1, 1], [9, 9], False, False),  # decodes of one length
        ([1, 1], [9, 8], True, False),  # padded keys need the mask
        ([3], [7], True, False),  # a chunk after context: causal, but offset by the context
    ],
)
def test_groups_without_padding_need_no_explicit_mask(query_lens, kv_lens, masked, causal):
    tables = [[0, 1, 2], [3, 4, 5]][: len(query_lens)]
    md = AttentionMetadata.build(
        query_lens=query_lens, kv_lens=kv_lens, block_tables=tables, page_size=4
    )
    (group,) = plan_attention(md).groups
    assert (group.mask is not None, group.causal) == (masked, causal)
