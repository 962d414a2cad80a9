"""Scheduler.add_prefilled: a request whose prompt K/V came from elsewhere enters, exactly.

The tests play the decode role by hand: reserve pages from the pool, move the request to
AWAITING_KV, then hand it to the scheduler, and check the exact state, tokens, pages and batches.
"""

from __future__ import annotations

import pytest

from backend.core.admission import CapacityLimits
from backend.core.errors import (
    DuplicateRequestId,
    InvalidTransition,
    InvariantViolation,
    IsolationError,
    StepProtocolError,
)
from backend.core.messages import StepResult
from backend.core.pages import PagePool, PageRef
from backend.core.request import FinishReason, Request, RequestState, SamplingParams
from backend.core.scheduler import Scheduler

S = RequestState


def make(
    pages: int = 16, *, running: int = 4, zero: bool = False, eos: int | None = None
) -> tuple[Scheduler, PagePool]:
    pool = PagePool(pages, 4, zero_on_free=zero)
    limits = CapacityLimits.from_pool(pool, 64)
    sched = Scheduler(pool, limits, max_batch_tokens=8, max_running=running, eos_token_id=eos)
    return sched, pool


def awaiting(pool: PagePool, rid: str, prompt_len: int, max_tokens: int) -> Request:
    """What the decode role does before the handoff: reserve the prompt's pages (on-demand
    allocation), then AWAITING_KV."""
    request = Request(rid, f"tenant-{rid}", tuple(range(prompt_len)), SamplingParams(max_tokens))
    needed = pool.pages_for(prompt_len)
    request.page_table = tuple(pool.allocate(needed, request.owner))
    request.transition(S.AWAITING_KV)
    return request


def test_prefilled_request_joins_the_batch_decoding_at_the_prompts_end() -> None:
    sched, pool = make()
    req = awaiting(pool, "a", 6, 3)  # a 6-token prompt -> pages 0, 1
    assert req.page_table == (PageRef(0, 1), PageRef(1, 1))
    sched.check_invariants(held_outside=2)

    result = sched.add_prefilled(req, 42)

    assert result == StepResult("a", 42, S.DECODING, None)
    assert (req.state, req.num_computed_tokens, req.output_ids) == (S.DECODING, 6, [42])
    assert (sched.num_running, sched.num_waiting, sched.get("a")) == (1, 0, req)
    sched.check_invariants()  # the pages are now the scheduler's, nothing held outside
    out = sched.schedule()
    decodes = [(d.request.request_id, d.position, d.input_token) for d in out.decodes]
    assert decodes == [("a", 6, 42)]
    assert out.prefills == () and out.decodes[0].page_table == req.page_table
    assert sched.postprocess(out, {"a": 5}) == [StepResult("a", 5, S.DECODING, None)]
    out = sched.schedule()  # position 7 is still in page 1: no page is taken
    assert len(req.page_table) == 2
    assert sched.postprocess(out, {"a": 9}) == [StepResult("a", 9, S.FINISHED, FinishReason.LENGTH)]
    assert (req.output_ids, req.page_table, pool.free_pages) == ([42, 5, 9], (), 16)
    sched.check_invariants()


@pytest.mark.parametrize(
    ("max_tokens", "token", "reason"),
    [(1, 7, FinishReason.LENGTH), (4, 2, FinishReason.STOP)],
)
def test_first_token_that_ends_it_finishes_and_frees_for_zeroing(
    max_tokens: int, token: int, reason: FinishReason
) -> None:
    sched, pool = make(zero=True, eos=2)
    req = awaiting(pool, "a", 4, max_tokens)
    pages = [ref.page_id for ref in req.page_table]

    assert sched.add_prefilled(req, token) == StepResult("a", token, S.FINISHED, reason)

    assert (req.state, req.finish_reason, req.page_table) == (S.FINISHED, reason, ())
    assert (sched.num_running, sched.get("a"), pool.owned_pages) == (0, None, 0)
    assert pool.pending_zero_pages == len(pages)
    assert sched.has_work()
    out = sched.schedule()
    assert list(out.pages_to_zero) == pages and out.decodes == () and out.prefills == ()
    sched.postprocess(out, {})
    pool.confirm_zeroed(out.pages_to_zero)
    sched.check_invariants()


def _refusal_cases(pool: PagePool) -> list[tuple[Request, int, type[Exception]]]:
    waiting = Request("w", "t", (1, 2), SamplingParams(2))
    partial = awaiting(pool, "p", 6, 4)
    partial.page_table = partial.page_table[:1]
    stale = awaiting(pool, "s", 4, 4)
    pool.free(stale.page_table, stale.owner)
    return [
        (waiting, 3, InvalidTransition),
        (awaiting(pool, "n", 4, 4), -1, StepProtocolError),
        (awaiting(pool, "b", 4, 4), True, StepProtocolError),
        (partial, 3, InvariantViolation),
        (stale, 3, IsolationError),
    ]


def test_every_refusal_changes_nothing() -> None:
    sched, pool = make(32)
    for req, token, error in _refusal_cases(pool):
        before = (req.state, req.page_table, req.num_computed_tokens, list(req.output_ids))
        with pytest.raises(error):
            sched.add_prefilled(req, token)
        after = (req.state, req.page_table, req.num_computed_tokens, list(req.output_ids))
        assert after == before, req.request_id
        assert (sched.num_running, sched.get(req.request_id)) == (0, None)


def test_no_running_slot_and_duplicate_id_are_refused() -> None:
    sched, pool = make(running=1)
    first = awaiting(pool, "a", 4, 4)
    sched.add_prefilled(first, 3)
    second = awaiting(pool, "b", 4, 4)
    with pytest.raises(InvariantViolation, match="no running slot"):
        sched.add_prefilled(second, 3)
    assert (second.state, second.output_ids, sched.num_running) == (S.AWAITING_KV, [], 1)

    sched2, pool2 = make()
    live = awaiting(pool2, "same", 4, 4)
    sched2.add_prefilled(live, 3)
    twin = awaiting(pool2, "same", 4, 4)
    with pytest.raises(DuplicateRequestId):
        sched2.add_prefilled(twin, 3)
    assert (twin.state, sched2.get("same")) == (S.AWAITING_KV, live)


def test_reserved_pages_come_back_through_the_scheduler_for_zeroing() -> None:
    sched, pool = make(zero=True)
    freed = awaiting(pool, "f", 8, 4)  # pages 0, 1
    drained = awaiting(pool, "d", 8, 4)  # pages 2, 3
    pool.quarantine(drained.page_table, drained.owner)
    sched.check_invariants(held_outside=2, quarantined_outside=2)
    with pytest.raises(InvariantViolation, match="owned pages"):
        sched.check_invariants(quarantined_outside=2)
    with pytest.raises(InvariantViolation, match="quarantined"):
        sched.check_invariants(held_outside=2)

    sched.kv.free_reserved(freed.page_table, freed.owner)
    sched.kv.release_reserved_quarantine(drained.page_table, drained.owner)

    assert pool.page(2).generation == 2  # leaving quarantine bumps the generation
    assert pool.page(0).generation == 1  # a plain free does not
    out = sched.schedule()
    assert list(out.pages_to_zero) == [0, 1, 2, 3]
    sched.postprocess(out, {})
    pool.confirm_zeroed(out.pages_to_zero)
    assert (pool.free_pages, pool.owned_pages, pool.quarantined_pages) == (16, 0, 0)
    sched.check_invariants()
