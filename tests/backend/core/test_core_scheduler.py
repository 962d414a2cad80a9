"""Scheduler: exact batches for continuous batching, chunked prefill, FIFO, finishing, aborts.

Tests that pin exact page ids of whole reservations run with ``Allocation.RESERVE`` (``RESERVE``
below); on-demand growth and preemption have their own file (``test_core_scheduler_preempt``)."""

from __future__ import annotations

import pytest

from backend.core.admission import CapacityLimits
from backend.core.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    InvalidRequest,
    InvalidTransition,
    IsolationError,
    IsolationReason,
    StepProtocolError,
)
from backend.core.kv_manager import Allocation
from backend.core.messages import SchedulerOutput, StepResult
from backend.core.pages import PagePool, PageRef, PageSnapshot
from backend.core.request import FinishReason, Request, RequestState, SamplingParams
from backend.core.scheduler import Scheduler

S = RequestState
RESERVE = Allocation.RESERVE
Shape = tuple[list[tuple[str, int]], list[tuple[str, int, int]]]


def make(
    pages: int = 16,
    page_size: int = 4,
    window: int = 64,
    *,
    batch: int = 8,
    running: int = 4,
    zero: bool = False,
    eos: int | None = None,
    allocation: Allocation = Allocation.ON_DEMAND,
) -> Scheduler:
    pool = PagePool(pages, page_size, zero_on_free=zero)
    limits = CapacityLimits.from_pool(pool, window)
    return Scheduler(
        pool,
        limits,
        max_batch_tokens=batch,
        max_running=running,
        eos_token_id=eos,
        allocation=allocation,
    )


def req(rid: str, prompt_len: int, max_tokens: int, stop: tuple[int, ...] = ()) -> Request:
    prompt = tuple(range(100, 100 + prompt_len))
    return Request(rid, f"tenant-{rid}", prompt, SamplingParams(max_tokens, stop_token_ids=stop))


def shape(out: SchedulerOutput) -> Shape:
    decodes = [(d.request.request_id, d.position) for d in out.decodes]
    prefills = [(c.request.request_id, c.start, c.end) for c in out.prefills]
    return decodes, prefills


def step(
    sched: Scheduler, tokens: dict[str, int] | None = None, default: int = 7
) -> tuple[Shape, list[StepResult]]:
    """One engine step as the runner will drive it, with invariants checked after it."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched._max_batch_tokens
    sched.pool.confirm_zeroed(out.pages_to_zero)
    for item in (*out.decodes, *out.prefills):
        sched.pool.verify(item.page_table, item.request.owner)
    sampled = {rid: (tokens or {}).get(rid, default) for rid in out.sampling_request_ids}
    results = sched.postprocess(out, sampled)
    sched.check_invariants()
    return shape(out), results


def snapshot(pool: PagePool) -> list[PageSnapshot]:
    return [pool.page(i) for i in range(pool.num_pages)]


def refs(*pairs: tuple[int, int]) -> tuple[PageRef, ...]:
    return tuple(PageRef(page_id, generation) for page_id, generation in pairs)


def test_chunked_prefill_boundaries_then_decode_to_length() -> None:
    sched = make(batch=8, allocation=RESERVE)
    a = req("a", 10, 3)
    sched.add(a)
    assert sched.num_waiting == 1 and a.page_table == ()
    assert step(sched) == (([], [("a", 0, 8)]), [])
    assert (a.state, a.num_computed_tokens, a.output_ids) == (S.PREFILLING, 8, [])
    assert a.page_table == refs((0, 1), (1, 1), (2, 1), (3, 1))  # 13 tokens -> 4 pages
    assert step(sched, {"a": 21}) == (
        ([], [("a", 8, 10)]),
        [StepResult("a", 21, S.DECODING, None)],
    )
    assert step(sched, {"a": 22}) == (([("a", 10)], []), [StepResult("a", 22, S.DECODING, None)])
    assert step(sched, {"a": 23}) == (
        ([("a", 11)], []),
        [StepResult("a", 23, S.FINISHED, FinishReason.LENGTH)],
    )
    assert (a.output_ids, a.num_computed_tokens, a.page_table) == ([21, 22, 23], 12, ())
    assert sched.pool.free_pages == 16 and not sched.has_work()


def test_decode_feeds_the_previous_token_at_the_next_position() -> None:
    sched = make(batch=8)
    sched.add(req("a", 3, 4))
    step(sched, {"a": 41})
    out = sched.schedule()
    (item,) = out.decodes
    assert (item.position, item.input_token, item.num_context_tokens) == (3, 41, 4)
    assert "41" not in repr(item)
    sched.postprocess(out, {"a": 42})
    out = sched.schedule()
    assert (out.decodes[0].position, out.decodes[0].input_token) == (4, 42)


def test_prompt_of_exactly_the_batch_budget_is_one_chunk() -> None:
    sched = make(batch=8)
    sched.add(req("a", 8, 2))
    assert step(sched) == (([], [("a", 0, 8)]), [StepResult("a", 7, S.DECODING, None)])


def test_new_request_joins_a_running_decode_batch() -> None:
    sched = make(batch=8, allocation=RESERVE)
    a, b = req("a", 4, 5), req("b", 10, 2)
    sched.add(a)
    step(sched)
    sched.add(b)
    # a decodes (1 token); b takes the remaining 7 of the budget.
    assert step(sched)[0] == ([("a", 4)], [("b", 0, 7)])
    assert a.page_table == refs((0, 1), (1, 1), (2, 1))
    assert b.page_table == refs((3, 1), (4, 1), (5, 1))
    shape3, results3 = step(sched, {"a": 1, "b": 2})
    assert shape3 == ([("a", 5)], [("b", 7, 10)])
    assert results3 == [StepResult("a", 1, S.DECODING, None), StepResult("b", 2, S.DECODING, None)]
    assert step(sched)[0] == ([("a", 6), ("b", 10)], [])
    assert (a.state, b.state, b.finish_reason) == (S.DECODING, S.FINISHED, FinishReason.LENGTH)


def test_requests_admitted_together_split_the_budget_in_fifo_order() -> None:
    sched = make(batch=8)
    for rid in ("a", "b", "c"):
        sched.add(req(rid, 5, 3))
    assert step(sched)[0] == ([], [("a", 0, 5), ("b", 0, 3)])
    assert step(sched)[0] == ([("a", 5)], [("b", 3, 5), ("c", 0, 5)])
    assert step(sched)[0] == ([("a", 6), ("b", 5), ("c", 5)], [])


def test_waiting_head_that_does_not_fit_blocks_later_requests_fifo() -> None:
    sched = make(pages=4, page_size=4, window=16, batch=16, allocation=RESERVE)
    a, b, c = req("a", 8, 4), req("b", 5, 3), req("c", 2, 2)  # 3, 2 and 1 pages
    for r in (a, b, c):
        sched.add(r)
    assert step(sched)[0] == ([], [("a", 0, 8)])
    # One page is free and c would fit in it, but b is first in line.
    assert (b.state, c.state, sched.pool.free_pages, sched.num_waiting) == (
        S.WAITING,
        S.WAITING,
        1,
        2,
    )
    assert step(sched)[0] == ([("a", 8)], [])
    assert step(sched)[0] == ([("a", 9)], [])
    assert step(sched)[1] == [StepResult("a", 7, S.FINISHED, FinishReason.LENGTH)]
    assert step(sched)[0] == ([], [("b", 0, 5), ("c", 0, 2)])
    # Free queue after a's allocation was [3]; a's pages 0, 1, 2 rejoined behind it.
    assert b.page_table == refs((3, 1), (0, 2))
    assert c.page_table == refs((1, 2))


def test_max_running_caps_admission() -> None:
    sched = make(batch=8, running=2)
    for rid, max_tokens in (("a", 1), ("b", 3), ("c", 1)):
        sched.add(req(rid, 2, max_tokens))
    assert step(sched)[0] == ([], [("a", 0, 2), ("b", 0, 2)])  # a finishes at its first token
    assert sched.get("c").state is S.WAITING  # type: ignore[union-attr]
    assert step(sched)[0] == ([("b", 2)], [("c", 0, 2)])


def test_eos_on_the_first_token_finishes_straight_from_prefill() -> None:
    sched = make(eos=0)
    a = req("a", 3, 10)
    sched.add(a)
    assert step(sched, {"a": 0})[1] == [StepResult("a", 0, S.FINISHED, FinishReason.STOP)]
    assert (a.state, a.finish_reason, a.output_ids) == (S.FINISHED, FinishReason.STOP, [0])
    assert sched.pool.free_pages == 16


def test_stop_token_finishes_while_decoding_and_wins_over_length() -> None:
    sched = make(eos=0)
    a, b = req("a", 3, 10, stop=(42,)), req("b", 3, 2)
    sched.add(a)
    sched.add(b)
    assert step(sched, {"a": 5, "b": 6})[1] == [
        StepResult("a", 5, S.DECODING, None),
        StepResult("b", 6, S.DECODING, None),
    ]
    assert step(sched, {"a": 42, "b": 0})[1] == [
        StepResult("a", 42, S.FINISHED, FinishReason.STOP),
        StepResult("b", 0, S.FINISHED, FinishReason.STOP),  # eos at the last allowed token
    ]
    assert (a.output_ids, b.output_ids) == ([5, 42], [6, 0])


def test_max_tokens_one_finishes_with_length_at_the_first_token() -> None:
    sched = make()
    sched.add(req("a", 3, 1))
    assert step(sched)[1] == [StepResult("a", 7, S.FINISHED, FinishReason.LENGTH)]


def test_rejected_request_never_touches_the_pool() -> None:
    sched = make(pages=256, page_size=16, window=8192, batch=64)
    sched.add(req("warm", 20, 4))
    step(sched)
    before = snapshot(sched.pool)
    too_long = req("big", 4990, 10)
    with pytest.raises(ContextLengthExceeded) as caught:
        sched.add(too_long)
    assert str(caught.value) == (
        "This engine's maximum request length is 4096 tokens (real KV pool: 4096, context "
        "window: 8192); the request needs 5000 tokens (4990 prompt + 10 max_tokens)"
    )
    assert (too_long.state, too_long.error, too_long.finish_reason) == (
        S.REJECTED,
        caught.value,
        FinishReason.ERROR,
    )
    assert too_long.page_table == ()
    assert snapshot(sched.pool) == before
    assert sched.get("big") is None and sched.num_waiting == 0
    assert step(sched)[0] == ([("warm", 20)], [])  # the big one is in no queue
    sched.check_invariants()


@pytest.mark.parametrize(("prompt_len", "pages"), [(4086, 256), (4085, 256), (4070, 255)])
def test_requests_up_to_the_drift_limit_are_admitted(prompt_len: int, pages: int) -> None:
    sched = make(pages=256, page_size=16, window=8192, batch=8192)
    request = req("r", prompt_len, 10)
    sched.add(request)
    assert step(sched)[0] == ([], [("r", 0, prompt_len)])
    assert (len(request.page_table), sched.pool.free_pages) == (pages, 256 - pages)


def test_empty_prompt_is_rejected_with_invalid_request() -> None:
    sched = make()
    empty = Request("e", "tenant", (), SamplingParams(4))
    with pytest.raises(InvalidRequest):
        sched.add(empty)
    assert empty.state is S.REJECTED and sched.pool.free_pages == 16


def test_duplicate_live_id_is_rejected_and_the_original_kept() -> None:
    sched = make()
    first, second = req("a", 3, 2), req("a", 3, 2)
    sched.add(first)
    with pytest.raises(DuplicateRequestId):
        sched.add(second)
    assert second.state is S.REJECTED and sched.get("a") is first
    with pytest.raises(InvalidTransition):
        sched.add(second)  # a terminal request cannot come back


def test_abort_waiting_request_touches_no_page() -> None:
    sched = make(pages=2, page_size=4, window=8)
    sched.add(req("a", 4, 4))
    b = req("b", 2, 2)
    sched.add(b)
    step(sched)
    before = snapshot(sched.pool)
    assert sched.abort("b") is b
    assert (b.state, b.finish_reason, b.error) == (S.ABORTED, FinishReason.ABORT, None)
    assert snapshot(sched.pool) == before and sched.num_waiting == 0
    sched.check_invariants()


def test_abort_between_steps_frees_pages_at_once() -> None:
    sched = make()
    a = req("a", 6, 4)
    sched.add(a)
    step(sched)
    table = a.page_table
    assert sched.abort("a") is a
    assert (a.state, a.page_table, sched.pool.free_pages) == (S.ABORTED, (), 16)
    with pytest.raises(IsolationError):
        sched.pool.verify(table, a.owner)
    sched.check_invariants()
    assert sched.abort("a") is None and a.state is S.ABORTED  # idempotent


def test_abort_during_a_step_quarantines_until_postprocess() -> None:
    sched = make(allocation=RESERVE)
    a, b = req("a", 6, 4), req("b", 2, 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    table = a.page_table
    sched.abort("a")
    assert (sched.pool.quarantined_pages, sched.pool.owned_pages) == (3, 2)
    sched.check_invariants()
    with pytest.raises(IsolationError) as caught:
        sched.pool.verify(table, a.owner)
    assert caught.value.reason == IsolationReason.WRONG_STATE
    # The runner may still report a's token; it is ignored.
    assert sched.postprocess(out, {"a": 9, "b": 8}) == [StepResult("b", 8, S.DECODING, None)]
    assert a.output_ids == [] and sched.pool.quarantined_pages == 0
    assert [sched.pool.page(ref.page_id).generation for ref in table] == [2, 2, 2]
    assert sched.pool.free_pages == 14
    sched.check_invariants()


def test_abort_of_finished_or_unknown_request_is_a_no_op() -> None:
    sched = make()
    a = req("a", 2, 1)
    sched.add(a)
    step(sched)
    assert a.state is S.FINISHED
    assert sched.abort("a") is None and a.state is S.FINISHED
    assert sched.abort("nobody") is None


def test_fail_frees_pages_and_records_the_error() -> None:
    sched = make()
    a = req("a", 6, 4)
    sched.add(a)
    step(sched)
    error = IsolationError("a", 0, 1, 2, IsolationReason.STALE_GENERATION)
    assert sched.fail("a", error) is a
    assert (a.state, a.error, a.finish_reason) == (S.FAILED, error, FinishReason.ERROR)
    assert sched.pool.free_pages == 16 and sched.fail("a", error) is None
    sched.check_invariants()


def test_fail_releases_only_pages_the_request_still_holds() -> None:
    sched = make(pages=4, page_size=4, window=16, allocation=RESERVE)
    a = req("a", 4, 4)
    sched.add(a)
    step(sched)
    # Simulate a stale reference (the reason a runner would fail a request): page 0 was
    # taken away behind the scheduler's back and now belongs to someone else.
    stolen = a.page_table[0]
    sched.pool.free([stolen], a.owner)
    other = sched.pool.allocate(3, req("x", 1, 1).owner)
    assert other[-1] == PageRef(0, 2)
    sched.fail("a", IsolationError("a", 0, 1, 2, IsolationReason.STALE_GENERATION))
    assert sched.pool.page(0).owner is not None and sched.pool.page(0).owner.request_id == "x"  # type: ignore[union-attr]
    assert sched.pool.page(1).owner is None
    sched.pool.check_invariants()


def test_zeroed_pages_are_surfaced_and_gate_admission() -> None:
    sched = make(pages=4, page_size=4, window=16, batch=16, zero=True, allocation=RESERVE)
    a, b = req("a", 4, 1), req("b", 8, 8)  # 2 pages, then all 4
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert shape(out) == ([], [("a", 0, 4)])
    sched.postprocess(out, {"a": 7})
    assert (a.state, sched.pool.pending_zero_pages, sched.pool.free_pages) == (S.FINISHED, 2, 2)
    out = sched.schedule()
    assert out.pages_to_zero == (0, 1) and out.is_empty and b.state is S.WAITING
    sched.postprocess(out, {})
    out = sched.schedule()  # the runner did not confirm: b still cannot have those pages
    assert out.pages_to_zero == () and out.is_empty
    sched.postprocess(out, {})
    sched.pool.confirm_zeroed([0, 1])
    out = sched.schedule()
    assert shape(out) == ([], [("b", 0, 8)])
    assert b.page_table == refs((2, 1), (3, 1), (0, 2), (1, 2))


def test_pages_freed_by_abort_are_surfaced_for_zeroing() -> None:
    sched = make(zero=True)
    sched.add(req("a", 6, 2))
    step(sched)
    sched.abort("a")
    assert sched.has_work()
    assert sched.schedule().pages_to_zero == (0, 1)


def test_schedule_twice_without_postprocess_is_refused() -> None:
    sched = make()
    sched.add(req("a", 3, 2))
    out = sched.schedule()
    with pytest.raises(StepProtocolError):
        sched.schedule()
    other = SchedulerOutput(out.step, out.decodes, out.prefills, out.pages_to_zero)
    with pytest.raises(StepProtocolError):
        sched.postprocess(other, {"a": 1})  # equal, but not the step in flight
    sched.postprocess(out, {"a": 1})


@pytest.mark.parametrize(
    "sampled",
    [
        {},  # a's prompt completes: it must sample
        {"a": None},
        {"a": True},
        {"a": -1},
        {"a": 1, "b": 2},  # b's chunk does not end its prompt
        {"a": 1, "ghost": 2},
    ],
)
def test_postprocess_refuses_mismatched_tokens_and_changes_nothing(
    sampled: dict[str, int | None],
) -> None:
    sched = make(batch=8)
    a, b = req("a", 3, 2), req("b", 10, 2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert shape(out) == ([], [("a", 0, 3), ("b", 0, 5)])
    with pytest.raises(StepProtocolError):
        sched.postprocess(out, sampled)
    assert (a.num_computed_tokens, a.output_ids, b.num_computed_tokens) == (0, [], 0)
    assert sched.postprocess(out, {"a": 1, "b": None}) == [StepResult("a", 1, S.DECODING, None)]


def test_constructor_refuses_limits_not_measured_from_the_pool() -> None:
    pool = PagePool(16, 4, zero_on_free=False)
    with pytest.raises(ValueError):
        Scheduler(pool, CapacityLimits(4, 32, 64), max_batch_tokens=8, max_running=4)
    with pytest.raises(ValueError):
        Scheduler(pool, CapacityLimits(4, 16, 64), max_batch_tokens=3, max_running=4)
    with pytest.raises(ValueError):
        Scheduler(pool, CapacityLimits(4, 16, 64), max_batch_tokens=8, max_running=0)


def test_step_result_repr_hides_the_token() -> None:
    assert "987654" not in repr(StepResult("a", 987654, S.DECODING, None))
