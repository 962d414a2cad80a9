"""The decode role's queues around the engine scheduler: reserve, accept, end, drain."""

from __future__ import annotations

import random

import pytest

from backend.core.admission import CapacityLimits
from backend.core.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    InvariantViolation,
    StepProtocolError,
)
from backend.core.pages import PagePool, PageState
from backend.core.request import FinishReason, Request, RequestState, SamplingParams
from backend.disagg.decode_scheduler import DecodeScheduler, Release

S = RequestState


def build(pages: int = 8, *, max_running: int = 4, zero: bool = False) -> DecodeScheduler:
    pool = PagePool(pages, 4, zero_on_free=zero)
    limits = CapacityLimits.from_pool(pool, context_window=pages * 4)
    return DecodeScheduler(
        pool, limits, max_batch_tokens=64, max_running=max_running, eos_token_id=99
    )


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, "t", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens))


def test_admission_refuses_before_reserving() -> None:
    sched = build()
    too_long = req("big", 30, 4)
    with pytest.raises(ContextLengthExceeded):
        sched.add(too_long)
    assert too_long.state is S.REJECTED and sched.pool.free_pages == 8
    sched.add(req("a", 3, 2))
    with pytest.raises(DuplicateRequestId):
        sched.add(req("a", 3, 2))


def test_decode_admits_through_the_engine_schedulers_one_admission_path() -> None:
    """#22: the admit-before-reserving checks exist once; decode only says where requests wait."""
    from backend.core.scheduler import Scheduler

    assert "add" not in DecodeScheduler.__dict__
    assert DecodeScheduler.add is Scheduler.add
    sched = build()
    waiting = req("w", 3, 2)
    sched.add(waiting)
    sched.reserve_ready()
    with pytest.raises(DuplicateRequestId):  # live in decode's own queues, not the base's
        sched.add(req("w", 3, 2))
    assert sched.awaiting("w") is waiting and sched.num_running == 0


def test_reserve_is_fifo_and_covers_the_prompt_and_nobody_overtakes() -> None:
    sched = build()
    a, b, c = req("a", 13, 6), req("b", 13, 6), req("c", 1, 1)  # the prompts': 4, 4 and 1 pages
    for r in (a, b, c):
        sched.add(r)
    assert sched.reserve_ready() == [a, b]
    assert (a.state, b.state, c.state) == (S.AWAITING_KV, S.AWAITING_KV, S.WAITING)
    assert [ref.page_id for ref in a.page_table] == [0, 1, 2, 3]
    assert sched.pool.free_pages == 0 and sched.reserve_ready() == []
    sched.check_invariants()
    assert not sched.has_work()  # awaiting requests need no engine step


def test_accept_joins_the_decode_batch_and_steps_like_unified() -> None:
    sched = build()
    a = req("a", 5, 3)
    sched.add(a)
    sched.reserve_ready()
    result = sched.accept("a", 7)
    assert result.state is S.DECODING and a.output_ids == [7]
    assert a.num_computed_tokens == 5
    sched.check_invariants()
    out = sched.schedule()
    assert [(d.request.request_id, d.position, d.input_token) for d in out.decodes] == [("a", 5, 7)]
    assert out.prefills == ()
    sched.postprocess(out, {"a": 8})
    sched.check_invariants()


def test_a_first_token_can_finish_the_request_at_once() -> None:
    sched = build()
    one, eos = req("one", 5, 1), req("eos", 5, 4)
    for r in (one, eos):
        sched.add(r)
    sched.reserve_ready()
    assert sched.accept("one", 7).finish_reason is FinishReason.LENGTH
    assert sched.accept("eos", 99).finish_reason is FinishReason.STOP
    assert one.page_table == () and sched.pool.free_pages == 8
    sched.check_invariants()


def test_ending_while_awaiting_frees_or_drains_as_told() -> None:
    sched = build()
    freed, drained = req("f", 7, 1), req("d", 7, 1)  # 2 pages each
    for r in (freed, drained):
        sched.add(r)
    sched.reserve_ready()
    kept = drained.page_table
    sched.end_awaiting("f", S.ABORTED, release=Release.FREE)
    sched.end_awaiting("d", S.ABORTED, release=Release.DRAIN)
    assert sched.pool.quarantined_pages == 2 and sched.is_draining("d")
    assert [sched.pool.page(ref.page_id).state for ref in kept] == [PageState.QUARANTINED] * 2
    sched.check_invariants()
    # Nothing can be reserved on quarantined pages.
    sched.add(req("next", 20, 4))  # needs 6 pages: only 6 are free
    assert [r.request_id for r in sched.reserve_ready()] == ["next"]
    assert {ref.page_id for ref in sched.get("next").page_table}.isdisjoint(  # type: ignore[union-attr]
        ref.page_id for ref in kept
    )
    assert sched.release_drain("d") == 2
    # Leaving quarantine bumped the generation: the old references are dead.
    assert all(sched.pool.page(ref.page_id).generation == ref.generation + 1 for ref in kept)
    sched.check_invariants()


def test_reservation_counts_against_max_running() -> None:
    sched = build(pages=16, max_running=2)
    for rid in "abc":
        sched.add(req(rid, 1, 1))
    assert [r.request_id for r in sched.reserve_ready()] == ["a", "b"]
    sched.accept("a", 5)  # finishes (max_tokens=1): frees a slot
    assert [r.request_id for r in sched.reserve_ready()] == ["c"]


def test_accepting_a_request_that_is_not_awaiting_is_a_bug() -> None:
    sched = build()
    sched.add(req("a", 3, 2))
    with pytest.raises(InvariantViolation):
        sched.accept("a", 1)


def test_random_operations_keep_the_books_consistent() -> None:
    rng = random.Random(11)
    for _ in range(5):
        sched = build(pages=12, max_running=4, zero=rng.random() < 0.5)
        live: list[str] = []
        for i in range(120):
            action = rng.random()
            awaiting = [r for r in live if sched.awaiting(r) is not None]
            if action < 0.3:
                rid = f"r{i}"
                try:
                    sched.add(req(rid, rng.randint(1, 20), rng.randint(1, 8)))
                    live.append(rid)
                except ContextLengthExceeded:
                    pass
            elif action < 0.45 and awaiting:
                sched.accept(rng.choice(awaiting), rng.randint(0, 120))
            elif action < 0.55 and awaiting:
                how = rng.choice([Release.FREE, Release.DRAIN])
                sched.end_awaiting(rng.choice(awaiting), S.ABORTED, release=how)
            elif action < 0.65:
                for rid in [r for r in live if sched.is_draining(r)][:1]:
                    sched.release_drain(rid)
            elif action < 0.75 and live:
                rid = rng.choice(live)
                if sched.awaiting(rid) is None:
                    sched.abort_waiting(rid) or sched.abort(rid)
            elif sched.has_work():
                out = sched.schedule()
                # preempted requests recompute here, so prefill chunks sample too
                sched.postprocess(
                    out, {rid: rng.randint(0, 120) for rid in out.sampling_request_ids}
                )
            sched.reserve_ready()
            sched.check_invariants()


def test_a_refused_accept_leaves_the_request_awaiting_so_it_can_still_end() -> None:
    """``accept`` enters through ``Scheduler.add_prefilled``: a refusal changes nothing, and the
    caller ends the request, its pages freed, exactly as for a refused handoff."""
    sched = build(zero=True)
    a = req("a", 5, 3)
    sched.add(a)
    sched.reserve_ready()
    pages = [ref.page_id for ref in a.page_table]
    with pytest.raises(StepProtocolError):
        sched.accept("a", -1)
    assert (a.state, a.output_ids, sched.num_awaiting, sched.num_running) == (
        S.AWAITING_KV,
        [],
        1,
        0,
    )
    sched.check_invariants()
    error = StepProtocolError("bad first token")
    sched.end_awaiting("a", S.FAILED, error, release=Release.FREE)
    assert (a.state, a.error, a.page_table, sched.num_awaiting) == (S.FAILED, error, (), 0)
    assert [sched.pool.page(p).state for p in pages] == [PageState.PENDING_ZERO] * len(pages)
    sched.check_invariants()
