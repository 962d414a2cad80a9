"""On-demand pages and preemption: exact growth, the stated victim order (LIFO), the one release
path (stale references, zeroing before reuse), recomputation that keeps the answer."""

from __future__ import annotations

import random

import pytest

from backend.core.admission import CapacityLimits
from backend.core.errors import ContextLengthExceeded, IsolationError, IsolationReason
from backend.core.kv_manager import Allocation
from backend.core.messages import SchedulerOutput
from backend.core.pages import PagePool, PageRef, PageState
from backend.core.request import TERMINAL, FinishReason, Request, RequestState, SamplingParams
from backend.core.scheduler import Scheduler

S = RequestState


def make(
    pages: int, *, page_size: int = 4, zero: bool = False, running: int = 4, batch: int = 64
) -> Scheduler:
    pool = PagePool(pages, page_size, zero_on_free=zero)
    limits = CapacityLimits.from_pool(pool, pages * page_size)
    return Scheduler(pool, limits, max_batch_tokens=batch, max_running=running, watermark=0)


def req(rid: str, prompt_len: int, max_tokens: int) -> Request:
    prompt = tuple(range(1, prompt_len + 1))
    return Request(rid, f"tenant-{rid}", prompt, SamplingParams(max_tokens))


def model(tokens: tuple[int, ...]) -> int:
    """A deterministic stand-in for greedy decoding: the next token depends on every token."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) % 97) + 1


def run_step(sched: Scheduler) -> SchedulerOutput:
    """One engine step, the runner's part played by ``model`` over the tokens each item feeds."""
    out = sched.schedule()
    sched.pool.confirm_zeroed(out.pages_to_zero)
    for item in (*out.decodes, *out.prefills):
        sched.pool.verify(item.page_table, item.request.owner)
    sampled: dict[str, int | None] = {}
    for d in out.decodes:
        sampled[d.request.request_id] = model(d.request.token_ids(0, d.position + 1))
    for c in out.prefills:
        sampled[c.request.request_id] = model(c.request.token_ids(0, c.end)) if c.samples else None
    sched.postprocess(out, sampled)
    sched.check_invariants()
    return out


def drain(sched: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not sched.has_work():
            return
        run_step(sched)
    raise AssertionError("the scheduler did not drain")


def alone(prompt_len: int, max_tokens: int) -> list[int]:
    """The answer a request gets in a pool large enough never to preempt it."""
    sched = make(64)
    request = req("x", prompt_len, max_tokens)
    sched.add(request)
    drain(sched)
    return request.output_ids


def test_decoding_takes_one_page_when_its_next_position_starts_one() -> None:
    sched = make(8)
    a = req("a", 6, 5)
    sched.add(a)
    run_step(sched)  # prefill 6 tokens: pages 0, 1
    assert (a.state, [r.page_id for r in a.page_table]) == (S.DECODING, [0, 1])
    run_step(sched)  # position 6
    run_step(sched)  # position 7
    assert len(a.page_table) == 2
    out = run_step(sched)  # position 8 starts page 2
    assert [d.position for d in out.decodes] == [8]
    assert a.page_table == (PageRef(0, 1), PageRef(1, 1), PageRef(2, 1))
    drain(sched)
    assert (a.state, a.finish_reason, sched.pool.free_pages) == (S.FINISHED, FinishReason.LENGTH, 8)


def test_pool_runs_out_the_last_admitted_is_preempted_and_recomputes_its_answer() -> None:
    sched = make(4)  # 16 tokens
    a, b = req("a", 4, 8), req("b", 4, 8)  # 12 tokens each at most: they cannot both finish
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: a page 0, b page 1
    run_step(sched)  # both take a page for position 4: a page 2, b page 3
    assert (sched.pool.free_pages, a.num_output_tokens, b.num_output_tokens) == (0, 2, 2)
    for _ in range(3):  # positions 5, 6, 7 fit in the pages they hold
        run_step(sched)
    b_pages = b.page_table
    out = run_step(sched)  # a needs page 3 for position 8: b, admitted last, is preempted
    assert [d.request.request_id for d in out.decodes] == ["a"]
    assert (b.state, b.preemptions, b.page_table, b.num_computed_tokens) == (S.PREEMPTED, 1, (), 0)
    assert b.num_output_tokens == 5  # its output so far is kept
    assert sched.num_preemptions == 1 and sched.num_waiting == 1
    with pytest.raises(IsolationError) as caught:  # b's old references read nothing
        sched.pool.verify(b_pages, b.owner)
    assert caught.value.reason == IsolationReason.STALE_GENERATION  # pages 1, 3 now a's
    drain(sched)
    assert (a.state, b.state) == (S.FINISHED, S.FINISHED)
    assert a.output_ids == alone(4, 8) and b.output_ids == alone(4, 8)


def test_preempted_pages_are_zeroed_before_anyone_gets_them_again() -> None:
    sched = make(4, zero=True)
    a, b = req("a", 4, 8), req("b", 4, 8)
    sched.add(a)
    sched.add(b)
    for _ in range(5):
        run_step(sched)
    b_pages = [ref.page_id for ref in b.page_table]
    out = sched.schedule()  # a needs a page: b is preempted, its pages go out to be zeroed
    assert b.state is S.PREEMPTED and out.pages_to_zero == tuple(b_pages)
    assert out.decodes == ()  # a's page is only coming: it sits this step out
    assert [sched.pool.page(p).state for p in b_pages] == [PageState.PENDING_ZERO] * 2
    assert sched.pool.free_pages == 0  # nobody can have them before the runner zeroes them
    sched.pool.confirm_zeroed(out.pages_to_zero)
    sched.postprocess(out, {})
    out = run_step(sched)  # a takes one of them, at a new generation
    assert [d.request.request_id for d in out.decodes] == ["a"]
    assert a.page_table[-1].page_id in b_pages and a.page_table[-1].generation == 2
    drain(sched)
    assert a.output_ids == alone(4, 8) and b.output_ids == alone(4, 8)


def test_the_oldest_request_is_preempted_only_when_it_is_alone() -> None:
    """A decode-role shape: pages held outside the queues leave the only running request none."""
    sched = make(3)
    a = req("a", 4, 8)
    sched.add(a)
    run_step(sched)  # page 0
    held = sched.pool.allocate(2, req("outside", 1, 1).owner)  # e.g. awaiting a handoff
    sched.check_invariants(held_outside=2)
    out = sched.schedule()  # a needs a page for position 4: no victim but itself
    assert (a.state, a.page_table, sched.num_running, out.is_empty) == (S.PREEMPTED, (), 0, True)
    sched.postprocess(out, {})
    sched.check_invariants(held_outside=2)
    sched.kv.free_reserved(held, req("outside", 1, 1).owner)
    drain(sched)
    assert a.output_ids == alone(4, 8)


def test_a_lone_request_may_take_the_whole_pool_despite_the_watermark() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    sched = Scheduler(
        pool, CapacityLimits.from_pool(pool, 16), max_batch_tokens=64, max_running=4, watermark=2
    )
    big, small = req("big", 14, 2), req("small", 1, 1)
    sched.add(big)
    sched.add(small)
    out = run_step(sched)  # big takes all 4 pages; small waits for the watermark
    assert [c.request.request_id for c in out.prefills] == ["big"] and small.state is S.WAITING
    drain(sched)
    assert (big.state, small.state) == (S.FINISHED, S.FINISHED)


def test_admission_still_refuses_prompt_plus_max_tokens_over_the_pool() -> None:
    sched = make(4)
    with pytest.raises(ContextLengthExceeded):
        sched.add(req("big", 10, 7))  # 17 > 16 tokens, although its prompt alone fits
    assert sched.pool.free_pages == 4


def test_preempted_request_can_be_aborted_or_failed_holding_nothing() -> None:
    sched = make(4)
    a, b = req("a", 4, 8), req("b", 4, 8)
    sched.add(a)
    sched.add(b)
    for _ in range(6):
        run_step(sched)
    assert b.state is S.PREEMPTED
    assert sched.abort("b") is b and (b.state, b.finish_reason) == (S.ABORTED, FinishReason.ABORT)
    sched.check_invariants()
    drain(sched)
    assert a.state is S.FINISHED and sched.pool.free_pages == 4


def test_reserve_allocation_never_preempts() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    sched = Scheduler(
        pool,
        CapacityLimits.from_pool(pool, 16),
        max_batch_tokens=64,
        max_running=4,
        allocation=Allocation.RESERVE,
    )
    a, b = req("a", 4, 8), req("b", 4, 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert (len(a.page_table), b.state) == (3, S.WAITING)  # all of a's 12 tokens up front
    drain(sched)
    assert sched.num_preemptions == 0 and a.output_ids == b.output_ids == alone(4, 8)


@pytest.mark.parametrize("zero_on_free", [False, True])
def test_random_overload_every_answer_equals_its_unpreempted_answer(zero_on_free: bool) -> None:
    rng = random.Random(5)
    sched = make(10, zero=zero_on_free, running=6, batch=24)
    requests = []
    for i in range(40):
        request = req(f"r{i}", rng.randint(1, 20), rng.randint(1, 18))
        requests.append(request)
        sched.add(request)
        for _ in range(rng.randint(0, 3)):
            run_step(sched)
    drain(sched)
    assert all(r.state in TERMINAL for r in requests)
    assert sched.num_preemptions >= 10
    assert sum(r.preemptions > 0 for r in requests) >= 5
    for r in requests:
        assert r.output_ids == alone(r.num_prompt_tokens, r.sampling.max_tokens), r
    assert sched.pool.free_pages == 10
