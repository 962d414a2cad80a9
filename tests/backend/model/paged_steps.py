"""Running a model through the engine's paged path by hand, as the runner would: shuffled pages
from a free list, one `AttentionMetadata` per step, several sequences per step."""

from __future__ import annotations

import random

import torch

from backend.kernels.metadata import AttentionMetadata


class PagedRequests:
    """Hands out shuffled page ids to requests, as a page pool would."""

    def __init__(self, seed: int, num_pages: int, page_size: int) -> None:
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.num_pages = num_pages
        self.page_size = page_size
        self.tables: dict[str, list[int]] = {}

    def table(self, name: str, kv_len: int) -> list[int]:
        table = self.tables.setdefault(name, [])
        while len(table) * self.page_size < kv_len:
            table.append(self.free.pop())
        return table


def run_step(model, cache, pages: PagedRequests, step) -> dict[str, torch.Tensor]:
    """step: list of (name, token ids this step, kv_len after the step) -> each one's logits."""
    md = AttentionMetadata.build(
        query_lens=[len(ids) for _, ids, _ in step],
        kv_lens=[kv for _, _, kv in step],
        block_tables=[pages.table(name, kv) for name, _, kv in step],
        page_size=pages.page_size,
        num_pages=pages.num_pages,
    )
    ids = torch.tensor([t for _, toks, _ in step for t in toks])
    logits = model(ids, md.positions(), md, cache, all_logits=True)
    out, start = {}, 0
    for name, toks, _ in step:
        out[name] = logits[start : start + len(toks)]
        start += len(toks)
    return out


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    from tiny_families import fresh_rope

    fresh_rope(hf)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]
