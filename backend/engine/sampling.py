"""Token sampling for one step's batch: greedy at temperature 0, else temperature + top-p.

Seeded requests are reproducible: the generator for a request's n-th token is seeded from
(seed, n), so the same request gives the same text whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.core.request import SamplingParams

_SEED_STRIDE = 1_000_003


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> list[int]:
    """logits [B, vocab] (float32) -> one token id per row."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, (p, step) in enumerate(zip(params, steps, strict=True)):
        if p.temperature > 0.0:
            tokens[row] = _sample_row(logits[row], p, step)
    return [int(t) for t in tokens]


def _sample_row(row: torch.Tensor, p: SamplingParams, step: int) -> int:
    probs = torch.softmax(row / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    generator = torch.Generator(device=row.device)
    if p.seed is None:
        generator.seed()
    else:
        generator.manual_seed((p.seed * _SEED_STRIDE + step) % (2**63))
    return int(torch.multinomial(probs, 1, generator=generator).item())
