"""`AttentionMetadata`: the one typed message that tells attention where each sequence's KV lives.

Lifecycle: the runner builds one per forward step with `AttentionMetadata.build(...)` from the
pages the page pool handed out (plain page ids; this module knows nothing of owners or
generations), passes it to `LlamaModel.forward`, and drops it after the step. The batch is
flattened: sequence `i` owns query tokens `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, which are the last
`query_len` tokens of its `kv_len` tokens. A decode token is a sequence with `query_len == 1`; a
prefill chunk has `query_len > 1` and may follow earlier chunks already in the cache.

Rows of `block_tables` are padded with page 0 past each sequence's last page. Padding entries are
never read: every path bounds reads by `kv_lens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: query start offsets in the flattened batch
    kv_lens: torch.Tensor  # [B] int32: tokens in the cache after this step's writes
    block_tables: torch.Tensor  # [B, max_pages] int32: page ids of each sequence, in order
    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset for each new token
    token_positions: torch.Tensor  # [T] int64: absolute position of each query token
    page_size: int
    # Host copies of the lengths, so planning a launch never waits on the device.
    query_lens_host: tuple[int, ...]
    kv_lens_host: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens_host)

    def last_token_indices(self) -> torch.Tensor:
        """Index of each sequence's last query token in the flattened batch."""
        return (self.cu_seqlens_q[1:] - 1).long()

    def positions(self) -> torch.Tensor:
        """[T] int64 absolute positions of the query tokens (what RoPE needs)."""
        return self.token_positions

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        kv_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        page_size: int,
        num_pages: int | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Checks the plan on the host, then derives cu_seqlens, padded tables and slots."""
        _check_plan(query_lens, kv_lens, block_tables, page_size, num_pages)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(q_lens, 0)
        width = max(len(row) for row in block_tables)
        padded = [[*row, *([0] * (width - len(row)))] for row in block_tables]
        table = torch.tensor(padded, dtype=torch.int32)
        pos = _positions(query_lens, kv_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
        pages = table[seq_of_token, pos // page_size].long()
        slots = pages * page_size + pos % page_size
        return cls(
            cu_seqlens_q=cu.to(device),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            slot_mapping=slots.to(device),
            token_positions=pos.to(device),
            page_size=page_size,
            query_lens_host=tuple(query_lens),
            kv_lens_host=tuple(kv_lens),
        )


def _positions(query_lens: Sequence[int], kv_lens: Sequence[int]) -> torch.Tensor:
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    starts = torch.tensor(kv_lens, dtype=torch.int64) - q_lens
    offsets = torch.arange(int(q_lens.sum())) - torch.repeat_interleave(
        torch.cumsum(q_lens, 0) - q_lens, q_lens
    )
    return torch.repeat_interleave(starts, q_lens) + offsets


def _check_plan(
    query_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
    num_pages: int | None,
) -> None:
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if not query_lens or not len(query_lens) == len(kv_lens) == len(block_tables):
        raise ValueError("query_lens, kv_lens and block_tables need one entry per sequence")
    for i, (q_len, kv_len, row) in enumerate(zip(query_lens, kv_lens, block_tables, strict=True)):
        if not 1 <= q_len <= kv_len:
            raise ValueError(f"sequence {i}: need 1 <= query_len ({q_len}) <= kv_len ({kv_len})")
        needed = -(-kv_len // page_size)
        if len(row) < needed:
            raise ValueError(f"sequence {i}: {kv_len} tokens need {needed} pages, got {len(row)}")
        bad = [p for p in row if p < 0 or (num_pages is not None and p >= num_pages)]
        if bad:
            raise ValueError(f"sequence {i}: page ids {bad} are outside the pool")
