"""Randomized workloads through the scheduler: adds (some too long), steps, aborts (also mid-step),
failures, stop tokens, preemptions; invariants after every call and a free pool once drained."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from backend.core.admission import CapacityLimits
from backend.core.errors import ContextLengthExceeded, InvariantViolation
from backend.core.messages import SchedulerOutput
from backend.core.pages import PagePool, PageSnapshot
from backend.core.request import TERMINAL, FinishReason, Request, RequestState, SamplingParams
from backend.core.scheduler import Scheduler

EOS = 0


def snapshot(pool: PagePool) -> list[PageSnapshot]:
    return [pool.page(i) for i in range(pool.num_pages)]


def new_request(rng: random.Random, serial: int) -> Request:
    prompt = tuple(rng.randrange(1, 50) for _ in range(rng.randint(1, 40)))
    stop = (rng.randrange(1, 50),) if rng.random() < 0.2 else ()
    sampling = SamplingParams(max_tokens=rng.randint(1, 30), stop_token_ids=stop)
    return Request(f"r{serial}", f"tenant-{rng.randrange(4)}", prompt, sampling)


def run_step(
    sched: Scheduler, rng: random.Random, live: dict[str, Request], seen: Counter[str]
) -> None:
    blocked = sched.num_waiting > 0 and sched.num_running < 4
    out = sched.schedule()
    sched.check_invariants()
    if blocked and sched.num_running < 4 and sched.num_waiting > 0:
        seen["head_waits_for_pages"] += 1
    seen["chunked_prefill"] += any(not c.samples for c in out.prefills)
    seen["joins_decode_batch"] += bool(out.decodes) and any(c.start == 0 for c in out.prefills)
    assert out.num_batched_tokens <= 16
    sched.pool.confirm_zeroed(out.pages_to_zero)
    for item in (*out.decodes, *out.prefills):
        sched.pool.verify(item.page_table, item.request.owner)
    if rng.random() < 0.1 and live:  # abort while the step is in flight
        sched.abort(rng.choice(sorted(live)))
        seen["quarantined_mid_step"] += sched.pool.quarantined_pages > 0
        sched.check_invariants()
    sampled = {
        rid: (EOS if rng.random() < 0.03 else rng.randrange(1, 50))
        for rid in out.sampling_request_ids
    }
    sched.postprocess(out, sampled)
    sched.check_invariants()
    check_results(out)


def check_results(out: SchedulerOutput) -> None:
    for request in [d.request for d in out.decodes] + [c.request for c in out.prefills]:
        if request.state is RequestState.FINISHED:
            assert request.page_table == ()
            if request.finish_reason is FinishReason.LENGTH:
                assert len(request.output_ids) == request.sampling.max_tokens
            else:
                last = request.output_ids[-1]
                assert last == EOS or last in request.sampling.stop_token_ids


@pytest.mark.parametrize("zero_on_free", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_keeps_invariants_and_drains_to_a_free_pool(
    seed: int, zero_on_free: bool
) -> None:
    rng = random.Random(seed)
    pool = PagePool(12, 4, zero_on_free=zero_on_free)  # 48 tokens
    sched = Scheduler(
        pool,
        CapacityLimits.from_pool(pool, 40),
        max_batch_tokens=16,
        max_running=4,
        eos_token_id=EOS,
    )
    every: list[Request] = []
    seen: Counter[str] = Counter()
    for serial in range(600):
        live = {r.request_id: r for r in every if r.state not in TERMINAL}
        roll = rng.random()
        if roll < 0.35:
            request = new_request(rng, serial)
            every.append(request)
            before = snapshot(pool)
            try:
                sched.add(request)
            except ContextLengthExceeded:
                assert request.state is RequestState.REJECTED
                assert request.max_total_tokens > 40 and snapshot(pool) == before
        elif roll < 0.42 and live:
            sched.abort(rng.choice(sorted(live)))
        elif roll < 0.45 and live:
            sched.fail(rng.choice(sorted(live)), InvariantViolation("drill"))
        else:
            run_step(sched, rng, live, seen)
        sched.check_invariants()
    for _ in range(1000):
        if not sched.has_work():
            break
        run_step(sched, rng, {}, seen)
    assert not sched.has_work()
    assert all(r.state in TERMINAL for r in every)
    assert pool.free_pages == pool.num_pages
    outcomes = Counter(r.state for r in every)
    reasons = Counter(r.finish_reason for r in every)
    # The workload really hit every path it claims to test.
    assert min(outcomes[state] for state in TERMINAL) >= 3, outcomes
    assert min(reasons[FinishReason.STOP], reasons[FinishReason.LENGTH]) >= 3, reasons
    for path in ("head_waits_for_pages", "chunked_prefill", "joins_decode_batch"):
        assert seen[path] >= 3, seen
    assert seen["quarantined_mid_step"] >= 1, seen
    assert sched.num_preemptions >= 3, sched.num_preemptions
