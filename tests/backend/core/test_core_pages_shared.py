"""PagePool's SHARED pages: share, acquire, unshare, evict; exact states, readers, generations."""

from __future__ import annotations

import pytest

from backend.core.errors import InvalidTransition, InvariantViolation, IsolationError
from backend.core.errors import IsolationReason as R
from backend.core.pages import Owner, PagePool, PageRef, PageSnapshot, PageState

A1, A2 = Owner("a1", "tenant-a"), Owner("a2", "tenant-a")
B = Owner("b", "tenant-b")


def shared_pool(zero: bool = False) -> tuple[PagePool, list[PageRef]]:
    pool = PagePool(4, 4, zero_on_free=zero)
    refs = pool.allocate(2, A1)
    pool.share(refs, A1, "scope-a")
    return pool, refs


def test_share_makes_owned_pages_read_only_and_keeps_the_owner_as_reader() -> None:
    pool, refs = shared_pool()
    assert pool.page(0) == PageSnapshot(0, PageState.SHARED, 1, None, "scope-a", frozenset({A1}))
    assert (pool.owned_pages, pool.shared_pages, pool.shared_reads) == (0, 2, 2)
    pool.verify(refs, A1)
    with pytest.raises(IsolationError) as caught:
        pool.verify(refs, A1, writes_from=1)
    assert (caught.value.reason, caught.value.page_id) == (R.READ_ONLY, 1)
    with pytest.raises(IsolationError):
        pool.free(refs, A1)  # a shared page leaves only by unshare + evict
    pool.check_invariants()


def test_acquire_needs_the_same_scope_and_a_current_reference() -> None:
    pool, refs = shared_pool()
    with pytest.raises(IsolationError) as caught:
        pool.acquire(refs, B, "scope-b")
    assert caught.value.reason == R.SCOPE_MISMATCH and pool.num_readers(0) == 1
    with pytest.raises(IsolationError) as caught:
        pool.acquire([PageRef(0, 2)], A2, "scope-a")
    assert caught.value.reason == R.STALE_GENERATION
    with pytest.raises(IsolationError) as caught:
        pool.acquire([refs[0], PageRef(2, 1)], A2, "scope-a")  # all or nothing
    assert pool.num_readers(0) == 1
    pool.acquire(refs, A2, "scope-a")
    assert pool.page(1).readers == frozenset({A1, A2}) and pool.shared_reads == 4
    pool.verify(refs, A2)
    with pytest.raises(IsolationError) as caught:
        pool.verify(refs, B)  # not a reader
    assert caught.value.reason == R.OWNER_MISMATCH
    with pytest.raises(IsolationError):
        pool.acquire(refs, A2, "scope-a")  # already a reader
    pool.check_invariants()


def test_unshare_then_evict_releases_through_the_zeroing_path() -> None:
    pool, refs = shared_pool(zero=True)
    pool.acquire(refs, A2, "scope-a")
    assert pool.unshare(refs, A1) == []  # A2 still reads them
    with pytest.raises(InvalidTransition):
        pool.evict([0])  # still read
    assert pool.unshare(refs, A2) == [0, 1]  # no reader left: the cache may evict them
    with pytest.raises(IsolationError):
        pool.verify(refs, A2)
    assert pool.state(0) is PageState.SHARED
    assert pool.evict([1, 0]) == [1, 0]
    assert (pool.state(0), pool.free_pages, pool.shared_pages) == (PageState.PENDING_ZERO, 2, 0)
    pool.confirm_zeroed([1, 0])
    again = pool.allocate(4, B)
    assert again[2:] == [PageRef(1, 2), PageRef(0, 2)]  # the next allocation bumps
    with pytest.raises(InvalidTransition):
        pool.evict([2])  # not shared
    pool.check_invariants()


def test_check_invariants_catches_a_shared_page_without_its_scope() -> None:
    pool, _ = shared_pool()
    del pool._scope[0]
    with pytest.raises(InvariantViolation):
        pool.check_invariants()
