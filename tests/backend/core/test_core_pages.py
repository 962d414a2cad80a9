"""PagePool: exact page ids and generations, zero-on-free gating, quarantine, verify, invariants."""

from __future__ import annotations

import dataclasses

import pytest

from backend.core.errors import (
    InvalidTransition,
    InvariantViolation,
    IsolationError,
    IsolationReason,
    OutOfPages,
)
from backend.core.pages import (
    PAGE_TRANSITIONS,
    Owner,
    PagePool,
    PageRef,
    PageSnapshot,
    PageState,
    pages_needed,
)

A = Owner("req-a", "tenant-a")
B = Owner("req-b", "tenant-b")
C = Owner("req-c", "tenant-c")


def refs(*pairs: tuple[int, int]) -> list[PageRef]:
    return [PageRef(page_id, generation) for page_id, generation in pairs]


def snapshot(pool: PagePool) -> list[PageSnapshot]:
    return [pool.page(i) for i in range(pool.num_pages)]


def counters(pool: PagePool) -> tuple[int, int, int, int]:
    return (pool.free_pages, pool.owned_pages, pool.quarantined_pages, pool.pending_zero_pages)


def test_transition_table_is_exactly_the_documented_lifecycle() -> None:
    assert dict(PAGE_TRANSITIONS) == {
        PageState.FREE: {PageState.OWNED},
        PageState.OWNED: {
            PageState.FREE,
            PageState.PENDING_ZERO,
            PageState.QUARANTINED,
            PageState.SHARED,
        },
        PageState.SHARED: {PageState.FREE, PageState.PENDING_ZERO},
        PageState.QUARANTINED: {PageState.FREE, PageState.PENDING_ZERO},
        PageState.PENDING_ZERO: {PageState.FREE},
    }


def test_fresh_pool_counters_and_pages_for() -> None:
    pool = PagePool(8, 16, zero_on_free=False)
    assert (pool.num_pages, pool.page_size) == (8, 16)
    assert counters(pool) == (8, 0, 0, 0)
    assert [pool.pages_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert pages_needed(4096, 16) == 256
    assert pool.page(3) == PageSnapshot(3, PageState.FREE, 0, None)
    pool.check_invariants()


def test_alloc_free_sequence_gives_exact_ids_and_generations_fifo_reuse() -> None:
    pool = PagePool(8, 4, zero_on_free=False)
    a = pool.allocate(3, A)
    b = pool.allocate(2, B)
    assert a == refs((0, 1), (1, 1), (2, 1))
    assert b == refs((3, 1), (4, 1))
    assert pool.free(a, A) == []
    assert counters(pool) == (6, 2, 0, 0)
    # Freed pages join the back of the queue: 5, 6, 7 come first, then 0, 1, 2 again.
    assert pool.allocate(4, C) == refs((5, 1), (6, 1), (7, 1), (0, 2))
    assert pool.free(b, B) == []
    assert pool.allocate(4, A) == refs((1, 2), (2, 2), (3, 2), (4, 2))
    assert pool.page(0) == PageSnapshot(0, PageState.OWNED, 2, C)
    pool.check_invariants()


def test_allocate_zero_and_negative() -> None:
    pool = PagePool(2, 4, zero_on_free=False)
    assert pool.allocate(0, A) == []
    with pytest.raises(ValueError):
        pool.allocate(-1, A)
    assert counters(pool) == (2, 0, 0, 0)


def test_out_of_pages_allocates_nothing() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    pool.allocate(3, A)
    before = snapshot(pool)
    with pytest.raises(OutOfPages) as caught:
        pool.allocate(2, B)
    assert (caught.value.requested, caught.value.free) == (2, 1)
    assert snapshot(pool) == before
    assert pool.allocate(1, B) == refs((3, 1))


def test_zero_on_free_pages_cannot_be_allocated_until_confirmed() -> None:
    pool = PagePool(4, 4, zero_on_free=True)
    a = pool.allocate(4, A)
    assert pool.free(a[:2], A) == [0, 1]
    assert counters(pool) == (0, 2, 0, 2)
    assert pool.page(0) == PageSnapshot(0, PageState.PENDING_ZERO, 1, None)
    with pytest.raises(OutOfPages):
        pool.allocate(1, B)
    pool.confirm_zeroed([1])
    assert pool.allocate(1, B) == refs((1, 2))
    with pytest.raises(OutOfPages):
        pool.allocate(1, C)
    pool.confirm_zeroed([0])
    assert pool.allocate(1, C) == refs((0, 2))
    pool.check_invariants()


def test_confirm_zeroed_refuses_pages_not_pending_and_is_all_or_nothing() -> None:
    pool = PagePool(4, 4, zero_on_free=True)
    a = pool.allocate(2, A)
    assert pool.free(a[:1], A) == [0]
    with pytest.raises(InvalidTransition):
        pool.confirm_zeroed([0, 1])  # page 1 is OWNED
    assert pool.page(0).state is PageState.PENDING_ZERO
    with pytest.raises(InvalidTransition):
        pool.confirm_zeroed([2])  # FREE
    with pytest.raises(InvalidTransition):
        pool.confirm_zeroed([0, 0])
    with pytest.raises(ValueError):
        pool.confirm_zeroed([4])
    assert counters(pool) == (2, 1, 0, 1)
    pool.confirm_zeroed([0])
    assert counters(pool) == (3, 1, 0, 0)


def test_free_without_zeroing_returns_nothing_to_zero() -> None:
    pool = PagePool(2, 4, zero_on_free=False)
    assert pool.free(pool.allocate(2, A), A) == []
    assert counters(pool) == (2, 0, 0, 0)


def test_free_checks_every_ref_before_moving_any_page() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    a = pool.allocate(2, A)
    b = pool.allocate(2, B)
    before = snapshot(pool)
    with pytest.raises(IsolationError) as caught:
        pool.free([a[0], b[0]], A)
    assert caught.value.reason == IsolationReason.OWNER_MISMATCH
    assert caught.value.page_id == 2
    with pytest.raises(InvalidTransition):
        pool.free([a[0], a[0]], A)
    assert snapshot(pool) == before


def test_double_free_and_stale_free_are_refused() -> None:
    pool = PagePool(1, 4, zero_on_free=False)
    a = pool.allocate(1, A)
    pool.free(a, A)
    with pytest.raises(IsolationError) as caught:
        pool.free(a, A)
    assert caught.value.reason == IsolationReason.WRONG_STATE
    pool.allocate(1, B)
    with pytest.raises(IsolationError) as caught:
        pool.free(a, A)
    assert caught.value.reason == IsolationReason.STALE_GENERATION
    assert pool.page(0) == PageSnapshot(0, PageState.OWNED, 2, B)


def test_quarantine_keeps_pages_owned_unreadable_and_unallocatable() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    a = pool.allocate(4, A)
    pool.quarantine(a[1:3], A)
    assert counters(pool) == (0, 2, 2, 0)
    assert pool.page(1) == PageSnapshot(1, PageState.QUARANTINED, 1, A)
    with pytest.raises(IsolationError) as caught:
        pool.verify(a, A)
    assert (caught.value.page_id, caught.value.reason) == (1, IsolationReason.WRONG_STATE)
    pool.verify([a[0], a[3]], A)
    with pytest.raises(IsolationError):
        pool.free(a[1:2], A)  # quarantined pages leave only through release_quarantined
    with pytest.raises(IsolationError):
        pool.quarantine(a[1:2], A)
    pool.free([a[0], a[3]], A)
    assert pool.allocate(2, B) == refs((0, 2), (3, 2))
    with pytest.raises(OutOfPages):
        pool.allocate(1, B)
    pool.check_invariants()


def test_release_quarantined_bumps_generation_and_frees() -> None:
    pool = PagePool(2, 4, zero_on_free=False)
    a = pool.allocate(2, A)
    pool.quarantine(a, A)
    with pytest.raises(IsolationError) as caught:
        pool.release_quarantined(a, B)
    assert caught.value.reason == IsolationReason.OWNER_MISMATCH
    assert pool.release_quarantined(a, A) == []
    assert snapshot(pool) == [
        PageSnapshot(0, PageState.FREE, 2, None),
        PageSnapshot(1, PageState.FREE, 2, None),
    ]
    with pytest.raises(IsolationError) as caught:
        pool.verify(a, A)
    assert caught.value.reason == IsolationReason.STALE_GENERATION
    assert pool.allocate(2, B) == refs((0, 3), (1, 3))
    pool.check_invariants()


def test_release_quarantined_with_zero_on_free_needs_confirmation() -> None:
    pool = PagePool(2, 4, zero_on_free=True)
    a = pool.allocate(2, A)
    pool.quarantine(a, A)
    assert pool.release_quarantined(a, A) == [0, 1]
    assert counters(pool) == (0, 0, 0, 2)
    assert pool.page(0) == PageSnapshot(0, PageState.PENDING_ZERO, 2, None)
    with pytest.raises(OutOfPages):
        pool.allocate(1, B)
    pool.confirm_zeroed([0, 1])
    assert pool.allocate(2, B) == refs((0, 3), (1, 3))


def test_release_of_pages_not_quarantined_is_refused() -> None:
    pool = PagePool(2, 4, zero_on_free=False)
    a = pool.allocate(2, A)
    with pytest.raises(IsolationError) as caught:
        pool.release_quarantined(a, A)
    assert caught.value.reason == IsolationReason.WRONG_STATE
    assert counters(pool) == (0, 2, 0, 0)


def test_verify_accepts_current_refs_of_an_equal_owner() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    a = pool.allocate(3, A)
    pool.verify(a, A)
    pool.verify(a, Owner("req-a", "tenant-a"))  # equal, not identical
    pool.verify([], A)
    assert pool.is_current(a[0], A)


def test_verify_raises_on_stale_generation_after_reuse() -> None:
    pool = PagePool(1, 4, zero_on_free=False)
    a = pool.allocate(1, A)
    pool.free(a, A)
    pool.allocate(1, B)
    with pytest.raises(IsolationError) as caught:
        pool.verify(a, A)
    error = caught.value
    assert (error.request_id, error.page_id) == ("req-a", 0)
    assert (error.expected_generation, error.actual_generation) == (1, 2)
    assert error.reason == IsolationReason.STALE_GENERATION
    assert "req-b" not in str(error) and "tenant-b" not in str(error)
    assert not pool.is_current(a[0], A)


def test_verify_raises_on_another_owners_pages() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    pool.allocate(2, A)
    b = pool.allocate(2, B)
    with pytest.raises(IsolationError) as caught:
        pool.verify(b, A)
    error = caught.value
    assert error.reason == IsolationReason.OWNER_MISMATCH
    assert (error.request_id, error.page_id, error.expected_generation) == ("req-a", 2, 1)
    assert "req-b" not in str(error) and "tenant-b" not in str(error)
    # Same request id, other tenant: still another owner.
    with pytest.raises(IsolationError):
        pool.verify(b, Owner("req-b", "tenant-x"))


def test_verify_raises_on_freed_and_unknown_pages() -> None:
    pool = PagePool(2, 4, zero_on_free=False)
    a = pool.allocate(2, A)
    pool.free(a[1:], A)
    with pytest.raises(IsolationError) as caught:
        pool.verify(a, A)
    assert (caught.value.page_id, caught.value.reason) == (1, IsolationReason.WRONG_STATE)
    with pytest.raises(IsolationError) as caught:
        pool.verify([a[0], PageRef(2, 1)], A)
    assert caught.value.reason == IsolationReason.UNKNOWN_PAGE
    assert caught.value.actual_generation is None


def test_page_ref_is_frozen_slotted_and_validated() -> None:
    ref = PageRef(3, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.generation = 2  # type: ignore[misc]
    assert not hasattr(ref, "__dict__")
    with pytest.raises(ValueError):
        PageRef(-1, 1)
    with pytest.raises(ValueError):
        PageRef(0, 0)


def test_check_invariants_detects_corrupted_books() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    pool.allocate(2, A)
    pool.check_invariants()
    pool._owner[3] = B  # a FREE page with an owner
    with pytest.raises(InvariantViolation, match="page 3"):
        pool.check_invariants()
    pool._owner[3] = None
    pool._free.append(2)  # an OWNED page in the free queue
    with pytest.raises(InvariantViolation):
        pool.check_invariants()
    pool._free.pop()
    pool.check_invariants()
    pool._generation[0] = 0  # generations only grow
    with pytest.raises(InvariantViolation, match="generation"):
        pool.check_invariants()


def test_check_invariants_detects_counter_drift() -> None:
    pool = PagePool(4, 4, zero_on_free=False)
    pool._counts[PageState.FREE] -= 1
    pool._counts[PageState.OWNED] += 1
    with pytest.raises(InvariantViolation, match="counters"):
        pool.check_invariants()
