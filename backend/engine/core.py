"""One engine step, synchronously: schedule -> zero freed pages -> verify -> run -> postprocess.

Between run and postprocess an optional ``after_forward`` hook sees the step while every page it
touched is still owned and verified (the prefill role copies finished prompts' KV out there).
Outside steps, ``tick`` does timed work and ``next_wakeup`` says when it is next due; the unified
engine has none (roles with handoffs override both).

The verify phase is the read-path ownership check: before attention may read a request's pages,
every (page id, generation) in its table must still be current and the request's (owned by it,
or a prefix-cache page it is a reader of), and the pages the step writes must be its own. A
mismatch fails that request alone with an ``IsolationError`` (reported to the caller, counted in
metrics, logged with ids only) and the rest of the batch runs; nothing is ever read silently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.core.errors import IsolationError, KvguardError
from backend.core.messages import (
    DecodeItem,
    PrefillChunk,
    SchedulerOutput,
    StepResult,
    TokenLogprobs,
)
from backend.core.request import Request
from backend.core.scheduler import Scheduler
from backend.engine.runner import ModelRunner, StepSamples
from contracts.engine import HandoffProof

log = logging.getLogger("kvguard.engine")


class EngineStepFailed(KvguardError):
    """The forward pass raised; every request of the step fails with this error."""

    code = "engine_error"
    http_status = 500

    def __init__(self, problem: str) -> None:
        super().__init__(f"the engine failed to run a step: {problem}", problem)


@dataclass(slots=True)
class StepOutcome:
    results: list[StepResult] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    verify_s: float = 0.0
    forward_s: float = 0.0
    zeroed_pages: int = 0
    preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    proofs: dict[str, HandoffProof] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict, repr=False)

    def merge(self, other: StepOutcome) -> None:
        self.results += other.results
        self.failed += other.failed
        self.proofs.update(other.proofs)
        self.logprobs.update(other.logprobs)


@dataclass(slots=True)
class EngineCore:
    scheduler: Scheduler
    runner: ModelRunner
    verify_pages: bool = True  # off only in benchmarks that measure the check's cost
    on_isolation_error: Callable[[IsolationError], None] | None = None
    after_forward: Callable[[SchedulerOutput], None] | None = None

    def add(self, request: Request) -> None:
        """Admission (raises; the request is then REJECTED and holds nothing)."""
        self.scheduler.add(request)

    def abort(self, request_id: str) -> Request | None:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def tick(self) -> StepOutcome:
        """Timed work outside steps (none in the unified engine)."""
        return StepOutcome()

    def next_wakeup(self) -> float | None:
        """Seconds until ``tick`` has work, or None if nothing is scheduled."""
        return None

    def step(self) -> StepOutcome:
        before = self._counts()
        output = self.scheduler.schedule()
        after = self._counts()
        outcome = StepOutcome(
            preemptions=after[0] - before[0],
            prefix_query_tokens=after[1] - before[1],
            prefix_hit_tokens=after[2] - before[2],
        )
        self._zero(output, outcome)
        if self.verify_pages:
            self._verify(output, outcome)
        started = time.perf_counter()
        try:
            sampled = self.runner.run(output) if not output.is_empty else StepSamples()
        except Exception as exc:  # any device error fails the step's requests, not the loop
            log.exception("step %d failed", output.step)
            sampled = self._fail_all(output, outcome, EngineStepFailed(type(exc).__name__))
        outcome.forward_s = time.perf_counter() - started
        for request_id, error in sampled.failed.items():  # e.g. a token its grammar refuses
            failed = self.scheduler.fail(request_id, error)
            if failed is not None:
                outcome.failed.append(failed)
        if self.after_forward is not None and not output.is_empty:
            self.after_forward(output)
        outcome.results = self.scheduler.postprocess(output, sampled.tokens)
        outcome.logprobs = sampled.logprobs
        return outcome

    def _counts(self) -> tuple[int, int, int]:
        """Running totals the step's outcome reports the change of (for metrics)."""
        cache = self.scheduler.kv.cache
        stats = (0, 0) if cache is None else (cache.stats.query_tokens, cache.stats.hit_tokens)
        return self.scheduler.num_preemptions, *stats

    def _zero(self, output: SchedulerOutput, outcome: StepOutcome) -> None:
        if output.pages_to_zero:
            self.runner.zero(output.pages_to_zero)
            self.scheduler.pool.confirm_zeroed(output.pages_to_zero)
            outcome.zeroed_pages = len(output.pages_to_zero)

    def _verify(self, output: SchedulerOutput, outcome: StepOutcome) -> None:
        started = time.perf_counter()
        pool = self.scheduler.pool
        size = pool.page_size
        items: list[DecodeItem | PrefillChunk] = [*output.decodes, *output.prefills]
        for item in items:
            request = item.request
            first_write = item.position if isinstance(item, DecodeItem) else item.start
            try:
                pool.verify(item.page_table, request.owner, writes_from=first_write // size)
            except IsolationError as error:
                log.error("isolation check failed: %s", error.details())
                if self.on_isolation_error is not None:
                    self.on_isolation_error(error)
                self.scheduler.fail(request.request_id, error)
                outcome.failed.append(request)
        outcome.verify_s = time.perf_counter() - started

    def _fail_all(
        self, output: SchedulerOutput, outcome: StepOutcome, error: KvguardError
    ) -> StepSamples:
        requests = [d.request for d in output.decodes] + [p.request for p in output.prefills]
        for request in requests:
            failed = self.scheduler.fail(request.request_id, error)
            if failed is not None:
                outcome.failed.append(failed)
        return StepSamples()
