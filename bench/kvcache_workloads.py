"""The workloads of ``bench_kvcache``: seeded, printable ASCII (the byte tokenizer's), same for
every side.

- ``chat_workload``: a replayed multi-turn chat. Client ``c`` belongs to tenant ``c % tenants``
  (``serve_engine`` names tenants ``tenant-{i % 4}``, and request ``i``'s client is
  ``i % clients``); its turn ``k`` prompt is the tenant's system prompt, then for each earlier
  turn the user message and the scripted assistant reply, then turn ``k``'s user message.
  Requests are ordered turn-major (all clients' turn 0, then turn 1, ...), so the closed loop
  (client ``j`` sends ``j, j + C, ...``) sends each client's turns in order, one after the other.
- ``long_workload``: prompts of a few dozen to a few hundred tokens asking for as much as fits
  (``max_tokens`` = window - prompt); each answer's real length is ``answers[i]``, after which
  the client stops reading (its stop sequence).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from backend.core.request import SamplingParams
from bench.engine_common import Workload

_PRINTABLE = [chr(c) for c in range(32, 127)]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_PRINTABLE) for _ in range(n))


@dataclass(frozen=True, slots=True)
class ChatSpec:
    tenants: int
    clients: int
    turns: int
    system_tokens: int
    message_tokens: int
    answer_tokens: int = 16
    seed: int = 24

    def describe(self) -> str:
        return (
            f"{self.clients} clients in {self.tenants} tenants, {self.turns} turns each, a "
            f"{self.system_tokens}-token system prompt per tenant, user messages and scripted "
            f"replies of {self.message_tokens} tokens, max_tokens {self.answer_tokens}"
        )


def chat_workload(spec: ChatSpec) -> Workload:
    if spec.tenants != 4 or spec.clients % spec.tenants:
        raise ValueError("serve_engine names 4 tenants: clients must be a multiple of 4")
    rng = random.Random(spec.seed)
    systems = [_text(rng, spec.system_tokens - 1) for _ in range(spec.tenants)]
    texts = []
    history = [systems[c % spec.tenants] for c in range(spec.clients)]
    for _ in range(spec.turns):
        for c in range(spec.clients):
            user = _text(rng, spec.message_tokens)
            texts.append(history[c] + user)
            history[c] += user + _text(rng, spec.message_tokens)
    return Workload(tuple(texts), (spec.answer_tokens,) * len(texts))


@dataclass(frozen=True, slots=True)
class LongSpec:
    requests: int
    clients: int
    prompt_range: tuple[int, int]
    answer_range: tuple[int, int]
    seed: int = 25

    def describe(self) -> str:
        (p_lo, p_hi), (a_lo, a_hi) = self.prompt_range, self.answer_range
        return (
            f"{self.requests} requests from {self.clients} clients, prompts of {p_lo}-{p_hi} "
            f"tokens asking for as much as fits (max_tokens = window - prompt), answers of "
            f"{a_lo}-{a_hi} tokens (log-uniform) ending at a stop sequence"
        )


@dataclass(frozen=True, slots=True)
class LongWorkload:
    base: Workload  # prompts and their max_tokens (as much as fits)
    answers: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.base)

    def prompt_ids(self, i: int) -> list[int]:
        return self.base.prompt_ids(i)

    def sampling(self, i: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.base.max_tokens[i], temperature=0.0)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def long_workload(spec: LongSpec, window: int) -> LongWorkload:
    rng = random.Random(spec.seed)
    texts, max_tokens, answers = [], [], []
    for _ in range(spec.requests):
        n = rng.randint(*spec.prompt_range)
        texts.append(_text(rng, n - 1))
        max_tokens.append(window - n)
        answers.append(_log_uniform(rng, *spec.answer_range))
    return LongWorkload(Workload(tuple(texts), tuple(max_tokens)), tuple(answers))
