"""PyTorch reference paged attention (the CPU default), planned once per forward step.

Lifecycle: `plan_attention(metadata)` runs once per step and turns the block tables into flat
slot indices and masks; `torch_paged_attention(q, k, v, plan, scale)` then runs once per layer
with no per-token Python work. Sequences are grouped so that one SDPA call serves many of them:
- decode tokens (query_len 1) are grouped by context length, each group padded to its longest
  (one group when the caller gives no `kv_bytes_per_token` to weigh padding against another
  call); in a decode group the query heads that share a KV head are that head's query rows, so
  GQA needs no expanded K/V;
- prefill chunks form one group too when padding them to the longest costs at most
  `_MAX_PADDING_WASTE` times the real work (equal-length prompts: no waste), else each chunk is
  its own group.

Padding never reads outside a sequence's pages: padded key positions gather the sequence's own
last token (masked out), padded query rows attend only to its first key (output discarded). So a
stale NaN/inf in a page owned by someone else cannot reach the softmax (0 * NaN is NaN).

A sliding window (Mistral: a query at position p sees keys p - window + 1 .. p) is part of the
plan: each sequence gathers only the keys its first query row can see, from
``max(0, first row - window + 1)``, and the mask hides the older ones from later rows. So a
long context under a small window costs the window, not the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.kernels.metadata import AttentionMetadata

_MAX_PADDING_WASTE = 2.0
# What one more decode group costs (its gathers and SDPA call), counted in bytes of K+V rows it
# could have padded instead: measured on a 2-core EPYC, ~1 MB (512 keys of 4 KV heads x 64, fp32).
_GROUP_COST_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class _Group:
    """Sequences served by one SDPA call, padded to max_q query rows and max_kv keys."""

    # [G, max_q] int64: the query token of each (sequence, row); padded rows repeat the last one
    tokens: torch.Tensor
    # [G, max_kv] int64: the cache slot of each key position
    slots: torch.Tensor
    # [G, 1, max_q, max_kv] bool: key visible to the query row. None when no key is padding and
    # the visibility is plain: every key (decodes of one length) or causal (see `causal`).
    mask: torch.Tensor | None
    # fresh prompts of one length (no earlier context): SDPA's own causal mask, which lets it skip
    # the blocks above the diagonal instead of computing and masking them
    causal: bool
    # indices into tokens.flatten() of the real rows; None when every row is real
    rows: torch.Tensor | None
    # [R] int64: the token index of each real row, where its output goes
    out_tokens: torch.Tensor


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """The reference path's view of one step's `AttentionMetadata`, shared by all layers (of one
    sliding window)."""

    groups: tuple[_Group, ...]
    num_tokens: int
    window: int | None = None


@dataclass(frozen=True, slots=True)
class _Spans:
    """Per sequence: the first key position gathered and how many keys are gathered."""

    first: tuple[int, ...]
    count: tuple[int, ...]

    @classmethod
    def of(cls, md: AttentionMetadata, window: int | None) -> _Spans:
        first = tuple(
            0 if window is None else max(0, kv - q - window + 1)
            for q, kv in zip(md.query_lens_host, md.kv_lens_host, strict=True)
        )
        count = tuple(kv - f for kv, f in zip(md.kv_lens_host, first, strict=True))
        return cls(first, count)


def plan_attention(
    md: AttentionMetadata, *, kv_bytes_per_token: int | None = None, window: int | None = None
) -> AttentionPlan:
    """``kv_bytes_per_token``: K plus V bytes of one token in one layer. With it, decodes are
    split into groups of similar length (``_decode_buckets``); without it they form one group.
    ``window``: the sliding window of the layers this plan serves (None: full attention)."""
    spans = _Spans.of(md, window)
    decode = [i for i, n in enumerate(md.query_lens_host) if n == 1]
    chunks = [i for i, n in enumerate(md.query_lens_host) if n > 1]
    buckets = _decode_buckets(spans, decode, kv_bytes_per_token)
    groups = [_plan_group(md, spans, seqs, window) for seqs in buckets]
    if chunks:
        padded = len(chunks) * max(md.query_lens_host[i] for i in chunks)
        padded *= max(spans.count[i] for i in chunks)
        real = sum(md.query_lens_host[i] * spans.count[i] for i in chunks)
        if padded <= _MAX_PADDING_WASTE * real:
            groups.append(_plan_group(md, spans, chunks, window))
        else:
            groups.extend(_plan_group(md, spans, [i], window) for i in chunks)
    return AttentionPlan(tuple(groups), md.num_tokens, window)


def _decode_buckets(
    spans: _Spans, seqs: list[int], kv_bytes_per_token: int | None
) -> list[list[int]]:
    """Split decodes by context length so padding to each group's longest wastes little.

    Cost model: a group costs a fixed ``_GROUP_COST_BYTES`` (its gathers and SDPA call) plus the
    bytes of its padded keys, which are gathered and read like real ones. The partition of the
    length-sorted sequences into runs is optimal for that model (dynamic programming over the
    sorted order; O(n^2) with n <= max_running, well under a millisecond).
    """
    if len(seqs) <= 1 or kv_bytes_per_token is None:
        return [seqs] if seqs else []
    order = sorted(seqs, key=lambda i: spans.count[i], reverse=True)
    lens = [spans.count[i] for i in order]
    group_cost = _GROUP_COST_BYTES / kv_bytes_per_token
    best = [0.0] + [float("inf")] * len(order)
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            cost = best[i] + group_cost + (j - i) * lens[i]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], len(order)
    while j > 0:
        # Batch order inside a group: a lone group's output rows are then the tokens in order.
        buckets.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return buckets[::-1]


def _plan_group(
    md: AttentionMetadata, spans: _Spans, seqs: list[int], window: int | None
) -> _Group:
    device = md.block_tables.device
    idx = torch.tensor(seqs, device=device)
    q_lens = torch.tensor([md.query_lens_host[i] for i in seqs], device=device)
    kv_lens = md.kv_lens[idx].long()
    first = torch.tensor([spans.first[i] for i in seqs], device=device)
    max_q = max(md.query_lens_host[i] for i in seqs)
    row = torch.arange(max_q, device=device)
    real = row[None, :] < q_lens[:, None]  # [G, max_q]
    start = md.cu_seqlens_q[idx].long()[:, None]
    tokens = start + torch.minimum(row[None, :], q_lens[:, None] - 1)
    # Absolute position of each query row; padded rows sit on the first key gathered.
    q_pos = torch.where(real, kv_lens[:, None] - q_lens[:, None] + row[None, :], first[:, None])
    key = torch.arange(max(spans.count[i] for i in seqs), device=device)
    # Absolute position of each key; padded keys gather the sequence's own last token.
    key_pos = torch.minimum(first[:, None] + key[None, :], kv_lens[:, None] - 1)
    pages = md.block_tables[idx].long().gather(1, key_pos // md.page_size)
    slots = pages * md.page_size + key_pos % md.page_size
    all_real = all(md.query_lens_host[i] == max_q for i in seqs)
    rows = None if all_real else real.flatten().nonzero().squeeze(1)
    out_tokens = tokens.flatten() if rows is None else tokens.flatten()[rows]
    counts = {spans.count[i] for i in seqs}
    fresh = window is None or max(counts) <= window  # every row sees all its causal keys
    if all_real and len(counts) == 1 and (max_q == 1 or (max_q in counts and fresh)):
        # No padding anywhere: a decode sees every key gathered, a fresh prompt is plain causal.
        return _Group(tokens, slots, None, max_q > 1, rows, out_tokens)
    absolute = first[:, None, None] + key[None, None, :]  # [G, 1, max_kv]
    mask = absolute <= q_pos[:, :, None]
    if window is not None:
        mask &= absolute > q_pos[:, :, None] - window
    return _Group(tokens, slots, mask[:, None], False, rows, out_tokens)


def torch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], caches [pages, page_size, kv_heads, D] -> [T, H, D]."""
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"plan is for {plan.num_tokens} tokens, q has {q.shape[0]}")
    kv_heads, head_dim = k_cache.shape[2:]
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    # One unpadded group holds every sequence in order, so its rows already are tokens 0..T-1.
    out = None if len(plan.groups) == 1 and plan.groups[0].rows is None else torch.empty_like(q)
    for group in plan.groups:
        # index_select on flat indices: several times faster on CPU than advanced indexing.
        num, max_q = group.tokens.shape
        max_kv = group.slots.shape[1]
        queries = q.index_select(0, group.tokens.flatten()).view(num, max_q, *q.shape[1:])
        keys = k_flat.index_select(0, group.slots.flatten()).view(num, max_kv, kv_heads, head_dim)
        values = v_flat.index_select(0, group.slots.flatten()).view(num, max_kv, kv_heads, head_dim)
        if max_q == 1:
            # Decode: the query heads sharing a KV head become that head's query rows, so SDPA
            # runs one [group, max_kv] problem per (sequence, KV head) without expanding K/V.
            attn = F.scaled_dot_product_attention(
                queries.view(num, kv_heads, -1, head_dim),  # [G, kv_heads, H/kv_heads, D]
                keys.transpose(1, 2),  # [G, kv_heads, max_kv, D]
                values.transpose(1, 2),
                attn_mask=group.mask,  # [G, 1, 1, max_kv] or None
                scale=scale,
            )
            flat = attn.reshape(num, q.shape[1], head_dim)
        else:
            attn = F.scaled_dot_product_attention(
                queries.transpose(1, 2),  # [G, H, max_q, D]
                keys.transpose(1, 2),  # [G, kv_heads, max_kv, D]
                values.transpose(1, 2),
                attn_mask=group.mask,
                is_causal=group.causal,
                scale=scale,
                enable_gqa=True,
            )
            flat = attn.transpose(1, 2).reshape(-1, q.shape[1], head_dim)
        if out is None:
            return flat
        real = flat if group.rows is None else flat.index_select(0, group.rows)
        out.index_copy_(0, group.out_tokens, real)
    assert out is not None  # plan_attention always yields at least one group
    return out
