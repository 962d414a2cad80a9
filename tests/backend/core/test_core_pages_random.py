"""Randomized alloc/free/quarantine/release/zero sequences against a shadow model.

Thousands of seeded steps; after every one ``check_invariants`` runs and the pool must agree with
the model exactly: FIFO page order, generation of every page, owners, state counts.
"""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from backend.core.errors import IsolationError, OutOfPages
from backend.core.pages import Owner, PagePool, PageRef, PageState

NUM_PAGES = 24


class Model:
    """What the pool should contain, tracked the simplest possible way."""

    def __init__(self, zero_on_free: bool) -> None:
        self.zero_on_free = zero_on_free
        self.free: deque[int] = deque(range(NUM_PAGES))
        self.generation = [0] * NUM_PAGES
        self.held: dict[Owner, list[PageRef]] = {}
        self.quarantined: dict[Owner, list[PageRef]] = {}
        self.pending: list[int] = []
        self.stale: list[tuple[Owner, PageRef]] = []

    def release(self, refs: list[PageRef]) -> list[int]:
        ids = [ref.page_id for ref in refs]
        if self.zero_on_free:
            self.pending += ids
            return ids
        self.free.extend(ids)
        return []


def op_allocate(pool: PagePool, model: Model, rng: random.Random, serial: int) -> str:
    owner = Owner(f"req-{serial}", f"tenant-{rng.randrange(3)}")
    n = rng.randint(0, 6)
    if n > len(model.free):
        with pytest.raises(OutOfPages):
            pool.allocate(n, owner)
        return "out_of_pages"
    expected = []
    for _ in range(n):
        page_id = model.free.popleft()
        model.generation[page_id] += 1
        expected.append(PageRef(page_id, model.generation[page_id]))
    assert pool.allocate(n, owner) == expected
    model.held[owner] = expected
    return "allocate"


def op_free(pool: PagePool, model: Model, rng: random.Random) -> None:
    owner = rng.choice(sorted(model.held, key=lambda o: o.request_id))
    refs = model.held.pop(owner)
    assert pool.free(refs, owner) == model.release(refs)
    model.stale += [(owner, ref) for ref in refs]


def op_quarantine(pool: PagePool, model: Model, rng: random.Random) -> None:
    owner = rng.choice(sorted(model.held, key=lambda o: o.request_id))
    refs = model.held.pop(owner)
    pool.quarantine(refs, owner)
    model.quarantined[owner] = refs


def op_release(pool: PagePool, model: Model, rng: random.Random) -> None:
    owner = rng.choice(sorted(model.quarantined, key=lambda o: o.request_id))
    refs = model.quarantined.pop(owner)
    for ref in refs:
        model.generation[ref.page_id] += 1
    assert pool.release_quarantined(refs, owner) == model.release(refs)
    model.stale += [(owner, ref) for ref in refs]


def op_confirm(pool: PagePool, model: Model, rng: random.Random) -> None:
    chosen = rng.sample(model.pending, rng.randint(1, len(model.pending)))
    pool.confirm_zeroed(chosen)
    model.pending = [page_id for page_id in model.pending if page_id not in chosen]
    model.free.extend(chosen)


def op_verify(pool: PagePool, model: Model, rng: random.Random) -> None:
    for owner, refs in model.held.items():
        pool.verify(refs, owner)
    for owner, refs in model.quarantined.items():
        if refs:
            with pytest.raises(IsolationError):
                pool.verify(refs, owner)
    if model.stale:
        owner, ref = rng.choice(model.stale)
        with pytest.raises(IsolationError):
            pool.verify([ref], owner)
    if len(model.held) >= 2:
        (a, a_refs), (b, _) = rng.sample(
            sorted(model.held.items(), key=lambda kv: kv[0].request_id), 2
        )
        if a_refs:
            with pytest.raises(IsolationError):
                pool.verify(a_refs, b)


def agree(pool: PagePool, model: Model) -> None:
    pool.check_invariants()
    held = sum(len(refs) for refs in model.held.values())
    quarantined = sum(len(refs) for refs in model.quarantined.values())
    assert (pool.free_pages, pool.owned_pages) == (len(model.free), held)
    assert (pool.quarantined_pages, pool.pending_zero_pages) == (quarantined, len(model.pending))
    assert list(pool._free) == list(model.free)
    for page_id in range(NUM_PAGES):
        assert pool.page(page_id).generation == model.generation[page_id]
    for owner, refs in model.held.items():
        assert all(pool.page(r.page_id).owner == owner for r in refs)
    for page_id in model.pending:
        assert pool.page(page_id).state is PageState.PENDING_ZERO


@pytest.mark.parametrize("zero_on_free", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sequences_keep_the_books_exact(seed: int, zero_on_free: bool) -> None:
    rng = random.Random(seed)
    pool = PagePool(NUM_PAGES, 8, zero_on_free=zero_on_free)
    model = Model(zero_on_free)
    done: Counter[str] = Counter()
    for serial in range(2500):
        choices = ["allocate", "verify"]
        choices += ["free", "quarantine"] * bool(model.held)
        choices += ["release"] * bool(model.quarantined)
        choices += ["confirm", "confirm"] * bool(model.pending)
        op = rng.choice(choices)
        if op == "allocate":
            op = op_allocate(pool, model, rng, serial)
        elif op == "free":
            op_free(pool, model, rng)
        elif op == "quarantine":
            op_quarantine(pool, model, rng)
        elif op == "release":
            op_release(pool, model, rng)
        elif op == "confirm":
            op_confirm(pool, model, rng)
        else:
            op_verify(pool, model, rng)
        done[op] += 1
        agree(pool, model)
    # The sequence really exercised every operation, including running out of pages.
    assert min(done.values()) >= 5
    assert set(done) >= {"allocate", "out_of_pages", "free", "quarantine", "release", "verify"}
    assert ("confirm" in done) == zero_on_free
