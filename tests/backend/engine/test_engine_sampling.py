"""Sampling on hand-made logits: penalties, logit_bias and logprobs with exact expectations."""

from __future__ import annotations

import math

import pytest
import torch

from backend.core.errors import InvalidRequest
from backend.core.request import SamplingParams
from backend.engine.sampling import LOGPROB_FLOOR, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0]])


def _greedy(**fields: object) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, **fields)  # type: ignore[arg-type]


def _one(params: SamplingParams, history: list[int] | None = None, logits: torch.Tensor = LOGITS):
    [sampled] = sample(logits, [params], [len(history or [])], [history or []])
    return sampled


def test_plain_greedy_takes_the_argmax_and_reports_nothing() -> None:
    sampled = _one(_greedy())
    assert sampled.token == 0 and sampled.logprobs is None


def test_logit_bias_moves_the_choice() -> None:
    assert _one(_greedy(logit_bias=((2, 1.6),))).token == 2  # 0.5 + 1.6 > 2.0
    assert _one(_greedy(logit_bias=((0, -100.0),))).token == 1


def test_frequency_penalty_counts_every_occurrence() -> None:
    # token 0 generated twice: 2.0 - 2 * 0.6 = 0.8 < 1.0, so token 1 wins; once: 1.4 > 1.0.
    assert _one(_greedy(frequency_penalty=0.6), history=[0, 0]).token == 1
    assert _one(_greedy(frequency_penalty=0.6), history=[0]).token == 0


def test_presence_penalty_counts_once() -> None:
    # presence only: 2.0 - 0.9 = 1.1 > 1.0 however often token 0 came.
    assert _one(_greedy(presence_penalty=0.9), history=[0, 0, 0]).token == 0
    assert _one(_greedy(presence_penalty=1.1), history=[0]).token == 1
    # a negative penalty encourages repetition: 1.0 + 1.5 > 2.0
    assert _one(_greedy(presence_penalty=-1.5), history=[1]).token == 1


def test_penalties_apply_only_to_generated_tokens_in_the_vocabulary() -> None:
    assert _one(_greedy(frequency_penalty=2.0), history=[]).token == 0
    assert _one(_greedy(frequency_penalty=2.0), history=[99]).token == 0  # out of range: ignored


def test_logprobs_are_the_raw_distribution_with_top_alternatives() -> None:
    expected = torch.log_softmax(LOGITS[0], dim=-1).tolist()
    sampled = _one(_greedy(logprobs=2, logit_bias=((3, 50.0),)))
    assert sampled.token == 3  # the bias picked it, the logprob is still the model's own
    assert sampled.logprobs is not None
    assert math.isclose(sampled.logprobs.logprob, expected[3], rel_tol=1e-6)
    assert [t for t, _ in sampled.logprobs.top] == [0, 1]
    for (token, logprob), want in zip(sampled.logprobs.top, expected[:2], strict=True):
        assert math.isclose(logprob, want, rel_tol=1e-6), token
    assert _one(_greedy(logprobs=0)).logprobs.top == ()  # type: ignore[union-attr]


def test_a_ruled_out_token_has_a_finite_floor() -> None:
    logits = torch.tensor([[0.0, -math.inf, 1.0]])
    sampled = _one(_greedy(logprobs=3, logit_bias=((1, 100.0),)), logits=logits)
    assert sampled.logprobs is not None
    assert all(math.isfinite(lp) for _, lp in sampled.logprobs.top)
    assert sampled.logprobs.top[-1] == (1, LOGPROB_FLOOR)


def test_seeded_sampling_is_reproducible_with_shaping() -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=7, presence_penalty=0.5)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    first = [_one(params, history=[3], logits=logits).token for _ in range(3)]
    assert len(set(first)) == 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_sampling_fields_are_refused_with_their_name(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(max_tokens=1, **fields)
    assert caught.value.param == param
