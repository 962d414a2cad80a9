"""Token sampling for one step's batch: shape the logits, pick a token, report its logprobs.

Per row, in order: the OpenAI penalties over the tokens generated so far (``logit -= count *
frequency_penalty + (count > 0) * presence_penalty``) and ``logit_bias``; then greedy at
temperature 0, else temperature + top-p. A request that asks for logprobs gets the chosen token's
log-probability and its ``logprobs`` most likely alternatives under the model's own distribution
(the raw logits, before penalties, bias and temperature: what vLLM reports by default), floored at
``LOGPROB_FLOOR`` so that a token the model rules out is still a JSON number.

Seeded requests are reproducible: the generator for a request's n-th token is seeded from
(seed, n), so the same request gives the same text whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from backend.core.messages import TokenLogprobs
from backend.core.request import SamplingParams

_SEED_STRIDE = 1_000_003
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int = field(repr=False)
    logprobs: TokenLogprobs | None = None


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    histories: Sequence[Sequence[int]] | None = None,
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> list[Sampled]:
    """logits [B, vocab] (float32) -> one sampled token per row; ``histories``: each row's
    generated tokens so far (needed only by rows with penalties); ``constrain``: masks the
    shaped logits in place (grammars: ``backend.engine.grammar``), last, so nothing it refuses
    can be sampled."""
    raw = logits
    if constrain is not None or any(p.shapes_logits for p in params):
        logits = logits.clone()
        for row, p in enumerate(params):
            if p.shapes_logits:
                _shape_row(logits[row], p, histories[row] if histories is not None else ())
        if constrain is not None:
            constrain(logits)
    tokens = torch.argmax(logits, dim=-1).tolist()
    out: list[Sampled] = []
    for row, (p, step) in enumerate(zip(params, steps, strict=True)):
        token = int(tokens[row]) if p.temperature <= 0.0 else _sample_row(logits[row], p, step)
        reported = None if p.logprobs is None else _logprobs(raw[row], token, p.logprobs)
        out.append(Sampled(token, reported))
    return out


def _shape_row(row: torch.Tensor, p: SamplingParams, history: Sequence[int]) -> None:
    vocab = row.shape[-1]
    if history and (p.presence_penalty or p.frequency_penalty):
        ids = torch.tensor([t for t in history if 0 <= t < vocab], dtype=torch.int64)
        counts = torch.bincount(ids, minlength=vocab).to(row.dtype)
        row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
    for token, bias in p.logit_bias:
        if token < vocab:  # the HTTP edge refuses ids outside the vocabulary
            row[token] += bias


def _logprobs(row: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    logprobs = torch.log_softmax(row.float(), dim=-1).clamp_min(LOGPROB_FLOOR)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(float(logprobs[token]), top)


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
