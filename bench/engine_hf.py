"""The two ``transformers`` baselines of ``bench_engine``, on the same checkpoint and workload.

- ``serial``: one ``generate()`` per request, one after another (what a naive server does).
  The server's timeline does not depend on how many clients wait, so it is measured once and
  each concurrency's closed loop is laid over it: request ``i >= C`` is sent when request
  ``i - C`` completes and waits in the queue until the server is free.
- ``static``: one ``generate()`` per batch of ``concurrency`` consecutive requests, left-padded
  with an attention mask, run until the longest ``max_tokens`` of the batch. A request's stream
  ends at its own last token; its client's next request then waits for the next batch.

Both run under ``torch.inference_mode()`` with the KV cache on (``use_cache=True``), greedy, in
the dtype the engine uses (the checkpoint's; fp32 here), with the same torch threads as the
engine. A streamer timestamps every
generation step, which gives TTFT and per-token latency for each request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.engine_common import BYTE_EOS, BYTE_PAD, Trace, Workload


@dataclass(slots=True)
class _StepClock:
    """A transformers streamer: the first ``put`` is the prompt, then one per generated step."""

    steps: list[tuple[float, list[int]]] = field(default_factory=list)
    _prompt_seen: bool = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.steps.append((time.perf_counter(), value.reshape(-1).tolist()))

    def end(self) -> None:
        pass


class HfBaselines:
    def __init__(self, checkpoint: Path, dtype: torch.dtype) -> None:
        """``dtype``: the one the engine runs this checkpoint in (its config's)."""
        from transformers import GenerationConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
        self.model.generation_config = GenerationConfig(
            do_sample=False, use_cache=True, pad_token_id=BYTE_PAD, eos_token_id=BYTE_EOS
        )

    def warm_up(self, workload: Workload) -> None:
        self._generate([workload.prompt_ids(0), workload.prompt_ids(1)], 4)

    def _generate(self, prompts: Sequence[list[int]], max_new_tokens: int) -> _StepClock:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), BYTE_PAD, dtype=torch.int64)
        mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the edge
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        clock = _StepClock()
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "streamer": clock}
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return clock

    def serial(self, workload: Workload) -> tuple[float, list[_Served]]:
        """Run every request alone, back to back; returns (start, per-request service record)."""
        start = time.perf_counter()
        served = []
        for i in range(len(workload)):
            began = time.perf_counter()
            clock = self._generate([workload.prompt_ids(i)], workload.max_tokens[i])
            served.append(_Served.from_steps(began, clock.steps, 0, workload.max_tokens[i]))
        return start, served

    def static(self, workload: Workload, concurrency: int) -> list[Trace]:
        """Batches of ``concurrency`` requests; traces under the closed loop (module docstring)."""
        start = time.perf_counter()
        traces: list[Trace] = []
        for first in range(0, len(workload), concurrency):
            batch = range(first, min(first + concurrency, len(workload)))
            began = time.perf_counter()
            limit = max(workload.max_tokens[i] for i in batch)
            clock = self._generate([workload.prompt_ids(i) for i in batch], limit)
            for row, i in enumerate(batch):
                served = _Served.from_steps(began, clock.steps, row, workload.max_tokens[i])
                prev = traces[i - concurrency].last_token if i >= concurrency else None
                traces.append(served.trace(start, sent_at=prev))
        return traces


@dataclass(frozen=True, slots=True)
class _Served:
    """One request's generation steps on the server (absolute perf_counter times)."""

    began: float
    times: tuple[float, ...]
    token_ids: tuple[int, ...] = field(repr=False)

    @classmethod
    def from_steps(
        cls, began: float, steps: Sequence[tuple[float, list[int]]], row: int, max_tokens: int
    ) -> _Served:
        times, ids = [], []
        for when, tokens in steps[:max_tokens]:
            times.append(when)
            ids.append(tokens[row])
            if tokens[row] == BYTE_EOS:
                break
        return cls(began, tuple(times), tuple(ids))

    @property
    def ended(self) -> float:
        return self.times[-1]

    def trace(self, run_start: float, *, sent_at: float | None) -> Trace:
        """``sent_at``: seconds since run start when the client sent it (None: at the start)."""
        trace = Trace(sent=0.0 if sent_at is None else sent_at)
        for when, token in zip(self.times, self.token_ids, strict=True):
            trace.record(when - run_start, token)
        return trace


def serial_closed_loop(start: float, served: Sequence[_Served], concurrency: int) -> list[Trace]:
    """The serial server's measured timeline as seen by ``concurrency`` closed-loop clients."""
    traces: list[Trace] = []
    for i, record in enumerate(served):
        sent = served[i - concurrency].ended - start if i >= concurrency else None
        traces.append(record.trace(start, sent_at=sent))
    return traces
