"""Triton paged attention: K/V are read on the device through each sequence's block table.

Two kernels, chosen per step by `triton_paged_attention`:
- `_decode_kernel` when every sequence has one query token. One program per (sequence, KV
  head) computes all query heads of that GQA group together, so each K/V block is loaded once per
  group; the group is padded to 16 rows because `tl.dot` needs at least 16.
- `_chunk_kernel` otherwise (prefill chunks, possibly mixed with decode tokens). One program per
  (sequence, query head, block of query tokens); each query row sees keys up to its own
  absolute position, which is causal inside the chunk and full over earlier context.

Both run an online softmax over blocks of BLOCK_N tokens. With a sliding window, a query at
position p sees keys p - window + 1 .. p: the loop starts at the first block any row of the
program can see and masks older keys per row (no window: `window` exceeds every position, so
nothing is masked and the loop starts at 0). A token's slot comes from
`block_tables[seq, token // PAGE_SIZE]`; loads past `kv_len` are masked, so padding entries of
the block table are never dereferenced. Page ids are widened to int64 before address arithmetic
because a large pool overflows int32 element offsets.

Under TRITON_INTERPRET=1 (read by `triton.jit` when this module is imported) the kernels run on
CPU tensors, which is how the tests compare them with the PyTorch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.kernels.metadata import AttentionMetadata

_BLOCK_N = 32
_BLOCK_M = 16
# Passed as the window when there is none: farther than any position (int32 arithmetic stays
# far from overflow), so every key up to the query is seen.
_NO_WINDOW = 1 << 30


@triton.jit
def _scores(q, k, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads no hints
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _weighted(p, v, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads no hints
    if IEEE:
        return tl.dot(p, v, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


@triton.jit
def _decode_kernel(  # type: ignore[no-untyped-def]  # Triton kernel arguments carry no hints
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, kv_lens_ptr, bt_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt, scale, head_dim, window,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(cu_q_ptr + seq).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < head_dim)
    q_ptrs = q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    oldest = tl.maximum(kv_len - window, 0)  # the query sits at kv_len - 1
    for start in range((oldest // BLOCK_N) * BLOCK_N, kv_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = (n < kv_len) & (n >= oldest)
        page = tl.load(bt_ptr + seq * stride_bt + n // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        kv_mask = valid[:, None] & (d[None, :] < head_dim)
        k_off = page * stride_kp + (n % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, IEEE) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v_off = page * stride_vp + (n % PAGE_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _weighted(p, v, IEEE)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _chunk_kernel(  # type: ignore[no-untyped-def]  # Triton kernel arguments carry no hints
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, kv_lens_ptr, bt_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt, scale, head_dim, window,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tl.program_id(2) * BLOCK_M < q_len:
        kv_len = tl.load(kv_lens_ptr + seq)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q_mask = (m[:, None] < q_len) & (d[None, :] < head_dim)
        rows = (q_start + m).to(tl.int64)
        q_ptrs = q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        # Absolute position of each query row: the chunk is the last q_len tokens of kv_len.
        pos = kv_len - q_len + m
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        kv_end = tl.minimum(kv_len, kv_len - q_len + (tl.program_id(2) + 1) * BLOCK_M)
        oldest = tl.maximum(kv_len - q_len + tl.program_id(2) * BLOCK_M - window + 1, 0)
        for start in range((oldest // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < kv_len
            page = tl.load(bt_ptr + seq * stride_bt + n // PAGE_SIZE, mask=valid, other=0)
            page = page.to(tl.int64)
            kv_mask = valid[:, None] & (d[None, :] < head_dim)
            k_off = page * stride_kp + (n % PAGE_SIZE) * stride_ks + kv_head * stride_kh
            k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = _scores(q, k, IEEE) * scale
            seen = (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window)
            s = tl.where(valid[None, :] & seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v_off = page * stride_vp + (n % PAGE_SIZE) * stride_vs + kv_head * stride_vh
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _weighted(p, v, IEEE)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as `paged_attention`; shapes are checked by the caller."""
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dimension of q and of the caches must be contiguous")
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[2]
    out = torch.empty_like(q)
    common = (
        q, k_cache, v_cache, out, metadata.cu_seqlens_q, metadata.kv_lens, metadata.block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        metadata.block_tables.stride(0), scale, head_dim,
        _NO_WINDOW if window is None else window,
    )  # fmt: skip
    block_d = max(16, triton.next_power_of_2(head_dim))
    ieee = q.dtype == torch.float32  # keep fp32 exact (no TF32) so it matches the reference
    if metadata.max_query_len == 1:
        grid: tuple[int, ...] = (metadata.num_seqs, k_cache.shape[2])
        block_g = max(16, triton.next_power_of_2(group))
        _decode_kernel[grid](
            *common, GROUP=group, PAGE_SIZE=metadata.page_size, BLOCK_G=block_g,
            BLOCK_D=block_d, BLOCK_N=_BLOCK_N, IEEE=ieee,
        )  # fmt: skip
    else:
        grid = (metadata.num_seqs, heads, triton.cdiv(metadata.max_query_len, _BLOCK_M))
        _chunk_kernel[grid](
            *common, GROUP=group, PAGE_SIZE=metadata.page_size, BLOCK_M=_BLOCK_M,
            BLOCK_D=block_d, BLOCK_N=_BLOCK_N, IEEE=ieee,
        )  # fmt: skip
    return out
