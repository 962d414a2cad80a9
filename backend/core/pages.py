"""The KV page pool: who holds each page, under which generation, and when it may be reused.

Lifecycle of one page (``PAGE_TRANSITIONS``; any other move raises ``InvalidTransition``)::

    FREE ──allocate──▶ OWNED ──free──▶ FREE               (zero_on_free off)
                         │   ──free──▶ PENDING_ZERO ──confirm_zeroed──▶ FREE   (zero_on_free on)
                         ├─quarantine─▶ QUARANTINED ──release_quarantined──▶ FREE | PENDING_ZERO
                         └─share──▶ SHARED ──evict (no reader left)──▶ FREE | PENDING_ZERO
                                      └─ acquire / unshare: readers come and go

Rules the rest of the engine relies on:

- Every allocation bumps the page's generation. A ``PageRef(page_id, generation)`` names one
  allocation, so a reference kept past its allocation can never match the page's next owner.
- ``verify`` is the read-path check: a reference is readable only while the page is OWNED by the
  same ``Owner``, or SHARED with that ``Owner`` among its readers, at the same generation. The
  runner calls it before attention touches a page; ``writes_from`` also requires the pages the
  step writes to be OWNED (a SHARED page is read-only).
- SHARED pages are the prefix cache's (``backend.core.prefix_cache``): full pages whose K/V was
  computed and will never be written again, held under a ``scope`` (the cache namespace, one per
  tenant unless an operator groups tenants) by a set of reader ``Owner``s. ``share`` turns an
  owner's page into one (the owner stays a reader); ``acquire`` adds a reader only of the same
  scope; ``unshare`` drops one. A SHARED page with no reader is still indexed by the cache; only
  ``evict`` (no reader left) releases it, through the same path as ``free``: zeroed before reuse,
  and the next allocation bumps its generation.
- QUARANTINED pages keep their owner but are unreadable and unallocatable: they are the pages of
  an aborted request whose remote writes may still be in flight. ``release_quarantined`` bumps the
  generation before the page leaves quarantine, so a late write that carries only the old
  generation tag (a transfer engine cannot see owners) is refused even after the page was zeroed.
  Plain ``free`` does not bump: freeing asserts no write is in flight, and the next allocation
  bumps before anyone else can hold the page.
- With ``zero_on_free`` a released page goes to PENDING_ZERO, not FREE. ``free`` and
  ``release_quarantined`` return those page ids; the caller zeroes the memory and then calls
  ``confirm_zeroed``. Until then ``allocate`` cannot hand the page out, so a page that still holds
  a previous tenant's K/V is never given to anyone.
- Free pages are reused in FIFO order (freed pages join the back of the queue): deterministic, and
  a just-freed page is the last one to be handed out again.

Pure bookkeeping: no tensors, no I/O. ``check_invariants`` proves the books agree with themselves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from backend.core.errors import (
    InvalidTransition,
    InvariantViolation,
    IsolationError,
    IsolationReason,
    OutOfPages,
)
from contracts.lifecycle import check_move


@dataclass(frozen=True, slots=True)
class PageRef:
    """One allocation of one page: valid while the page's generation is still ``generation``."""

    page_id: int
    generation: int

    def __deepcopy__(self, memo: dict[int, object]) -> PageRef:
        return self  # immutable: a copied page table shares its references

    def __post_init__(self) -> None:
        # A negative id would silently index from the end of the pool (and of the KV tensor).
        if self.page_id < 0:
            raise ValueError(f"page_id must be >= 0, got {self.page_id}")
        if self.generation < 1:
            raise ValueError(f"generation must be >= 1 (pages start at 0), got {self.generation}")


@dataclass(frozen=True, slots=True)
class Owner:
    """The request (and its tenant) that holds a page. Ids only."""

    request_id: str
    tenant: str

    def __deepcopy__(self, memo: dict[int, object]) -> Owner:
        return self  # immutable; PagePool.verify's fast path compares identity


class PageState(StrEnum):
    FREE = "free"
    OWNED = "owned"
    SHARED = "shared"
    QUARANTINED = "quarantined"
    PENDING_ZERO = "pending_zero"


PAGE_TRANSITIONS: Mapping[PageState, frozenset[PageState]] = MappingProxyType(
    {
        PageState.FREE: frozenset({PageState.OWNED}),
        PageState.OWNED: frozenset(
            {PageState.FREE, PageState.PENDING_ZERO, PageState.QUARANTINED, PageState.SHARED}
        ),
        PageState.SHARED: frozenset({PageState.FREE, PageState.PENDING_ZERO}),
        PageState.QUARANTINED: frozenset({PageState.FREE, PageState.PENDING_ZERO}),
        PageState.PENDING_ZERO: frozenset({PageState.FREE}),
    }
)

_HELD = frozenset({PageState.OWNED, PageState.QUARANTINED})


@dataclass(frozen=True, slots=True)
class PageSnapshot:
    """Read-only view of one page, for tests, metrics and debugging."""

    page_id: int
    state: PageState
    generation: int
    owner: Owner | None
    scope: str | None = None  # SHARED pages: the prefix-cache namespace
    readers: frozenset[Owner] = frozenset()  # SHARED pages: who may read them now


class PagePool:
    """Fixed-size page pool with per-page state, generation and owner."""

    def __init__(self, num_pages: int, page_size: int, *, zero_on_free: bool) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._num_pages = num_pages
        self._page_size = page_size
        self._zero_on_free = zero_on_free
        self._state: list[PageState] = [PageState.FREE] * num_pages
        self._generation: list[int] = [0] * num_pages
        self._owner: list[Owner | None] = [None] * num_pages
        self._scope: dict[int, str] = {}  # SHARED pages only
        self._readers: dict[int, set[Owner]] = {}  # SHARED pages only
        self._free: deque[int] = deque(range(num_pages))
        self._counts: dict[PageState, int] = {state: 0 for state in PageState}
        self._counts[PageState.FREE] = num_pages
        self._generations_at_last_check: list[int] = [0] * num_pages

    # -- counters ---------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def zero_on_free(self) -> bool:
        return self._zero_on_free

    @property
    def free_pages(self) -> int:
        """Pages ``allocate`` can hand out now (PENDING_ZERO pages are not among them)."""
        return self._counts[PageState.FREE]

    @property
    def owned_pages(self) -> int:
        return self._counts[PageState.OWNED]

    @property
    def quarantined_pages(self) -> int:
        return self._counts[PageState.QUARANTINED]

    @property
    def pending_zero_pages(self) -> int:
        return self._counts[PageState.PENDING_ZERO]

    @property
    def shared_pages(self) -> int:
        return self._counts[PageState.SHARED]

    @property
    def shared_reads(self) -> int:
        """(SHARED page, reader) pairs: how many page-table entries name a SHARED page."""
        return sum(len(readers) for readers in self._readers.values())

    def pages_for(self, n_tokens: int) -> int:
        """Pages needed to hold ``n_tokens`` tokens of KV."""
        return pages_needed(n_tokens, self._page_size)

    def free_queue(self) -> tuple[int, ...]:
        """The FIFO order ``allocate`` will hand FREE pages out in (for the model checker)."""
        return tuple(self._free)

    def fingerprint(self) -> tuple[object, ...]:
        """Every page's books and the free order, hashable (the model checker's state key)."""
        pages = tuple(
            (
                self._state[p],
                self._generation[p],
                None if self._owner[p] is None else self._owner[p].request_id,  # type: ignore[union-attr]
                self._scope.get(p),
                tuple(sorted(o.request_id for o in self._readers.get(p, ()))),
            )
            for p in range(self._num_pages)
        )
        return pages, tuple(self._free)

    def page(self, page_id: int) -> PageSnapshot:
        return PageSnapshot(
            page_id,
            self._state[page_id],
            self._generation[page_id],
            self._owner[page_id],
            self._scope.get(page_id),
            frozenset(self._readers.get(page_id, ())),
        )

    def state(self, page_id: int) -> PageState:
        return self._state[page_id]

    def num_readers(self, page_id: int) -> int:
        """Readers of a SHARED page (0 for any other state)."""
        return len(self._readers.get(page_id, ()))

    # -- ownership ----------------------------------------------------------------------------

    def allocate(self, n: int, owner: Owner) -> list[PageRef]:
        """Hand ``n`` FREE pages to ``owner``; all or nothing (``OutOfPages`` changes nothing)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        refs: list[PageRef] = []
        for _ in range(n):
            page_id = self._free.popleft()
            self._move(page_id, PageState.OWNED)
            generation = self._generation[page_id] + 1
            self._generation[page_id] = generation
            self._owner[page_id] = owner
            refs.append(PageRef(page_id, generation))
        return refs

    def free(self, refs: Sequence[PageRef], owner: Owner) -> list[int]:
        """Give back OWNED pages. Returns the ids the caller must zero, then ``confirm_zeroed``.

        The list is empty unless ``zero_on_free``. All refs are checked before any page moves.
        """
        self._check_refs(refs, owner, PageState.OWNED, unique=True)
        return self._release(refs)

    def quarantine(self, refs: Sequence[PageRef], owner: Owner) -> None:
        """Keep OWNED pages held but unreadable and unallocatable (writes may be in flight)."""
        self._check_refs(refs, owner, PageState.OWNED, unique=True)
        for ref in refs:
            self._move(ref.page_id, PageState.QUARANTINED)

    def release_quarantined(self, refs: Sequence[PageRef], owner: Owner) -> list[int]:
        """End a quarantine: bump generations, then free. Returns ids to zero (as ``free``)."""
        self._check_refs(refs, owner, PageState.QUARANTINED, unique=True)
        for ref in refs:
            self._generation[ref.page_id] += 1
        return self._release(refs)

    def confirm_zeroed(self, page_ids: Iterable[int]) -> None:
        """The caller zeroed these PENDING_ZERO pages' memory; they may now be allocated."""
        ids = list(page_ids)
        seen: set[int] = set()
        for page_id in ids:
            if not 0 <= page_id < self._num_pages:
                raise ValueError(f"no page {page_id} in a pool of {self._num_pages}")
            state = self._state[page_id]
            if state is not PageState.PENDING_ZERO or page_id in seen:
                problem = "listed twice" if page_id in seen else "page was not pending zeroing"
                raise InvalidTransition("page", str(page_id), state, PageState.FREE, problem)
            seen.add(page_id)
        for page_id in ids:
            self._move(page_id, PageState.FREE)
            self._free.append(page_id)

    # -- sharing (the prefix cache) ------------------------------------------------------------

    def share(self, refs: Sequence[PageRef], owner: Owner, scope: str) -> None:
        """Make ``owner``'s OWNED pages read-only SHARED pages of ``scope``; ``owner`` stays a
        reader. The caller guarantees nothing will write them again (they are full)."""
        if not scope:
            raise ValueError("a shared page needs a scope")
        self._check_refs(refs, owner, PageState.OWNED, unique=True)
        for ref in refs:
            self._move(ref.page_id, PageState.SHARED)
            self._owner[ref.page_id] = None
            self._scope[ref.page_id] = scope
            self._readers[ref.page_id] = {owner}

    def acquire(self, refs: Sequence[PageRef], owner: Owner, scope: str) -> None:
        """Add ``owner`` as a reader of SHARED pages of ``scope`` (all or nothing).

        Raises ``IsolationError``: a stale reference, a page that is not SHARED, a page of
        another scope (``SCOPE_MISMATCH``: the cache must never hand one out), or one that
        ``owner`` already reads.
        """
        seen: set[int] = set()
        for ref in refs:
            error = self._mismatch(ref, owner, PageState.SHARED, reader=False)
            if error is None and self._scope[ref.page_id] != scope:
                error = self._error(ref, owner, IsolationReason.SCOPE_MISMATCH)
            if error is None and (owner in self._readers[ref.page_id] or ref.page_id in seen):
                error = self._error(ref, owner, IsolationReason.OWNER_MISMATCH)
            if error is not None:
                raise error
            seen.add(ref.page_id)
        for ref in refs:
            self._readers[ref.page_id].add(owner)

    def unshare(self, refs: Sequence[PageRef], owner: Owner) -> list[int]:
        """``owner`` stops reading these SHARED pages; returns those that no one reads now."""
        self._check_refs(refs, owner, PageState.SHARED, unique=True)
        idle: list[int] = []
        for ref in refs:
            readers = self._readers[ref.page_id]
            readers.discard(owner)
            if not readers:
                idle.append(ref.page_id)
        return idle

    def evict(self, page_ids: Sequence[int]) -> list[int]:
        """Release SHARED pages no one reads (the cache forgets them). Returns ids to zero."""
        for page_id in page_ids:
            state = self._state[page_id]
            if state is not PageState.SHARED or self._readers[page_id]:
                problem = "still read" if state is PageState.SHARED else "not shared"
                raise InvalidTransition("page", str(page_id), state, PageState.FREE, problem)
        if len(set(page_ids)) != len(page_ids):
            raise ValueError("a page is listed twice")
        refs = [PageRef(page_id, self._generation[page_id]) for page_id in page_ids]
        for page_id in page_ids:
            del self._scope[page_id], self._readers[page_id]
        return self._release(refs)

    # -- checks -------------------------------------------------------------------------------

    def verify(
        self, refs: Sequence[PageRef], owner: Owner, *, writes_from: int | None = None
    ) -> None:
        """Raise ``IsolationError`` unless ``owner`` may read every ref at its generation: the
        page OWNED by ``owner``, or SHARED with ``owner`` among its readers. ``writes_from``:
        refs from this index on are written by the step, so they must be OWNED (``READ_ONLY``).

        The hot path compares ints and identities only; on the first mismatch the slow path
        re-checks to build a precise error.
        """
        states, generations, owners = self._state, self._generation, self._owner
        owned, shared, readers = PageState.OWNED, PageState.SHARED, self._readers
        limit = len(refs) if writes_from is None else writes_from
        try:
            for index, ref in enumerate(refs):
                page_id = ref.page_id
                if generations[page_id] != ref.generation:
                    break
                state = states[page_id]
                if state is owned:
                    holder = owners[page_id]
                    if holder is not owner and holder != owner:
                        break
                elif state is not shared or index >= limit or owner not in readers[page_id]:
                    break
            else:
                return
        except IndexError:
            pass
        for index, ref in enumerate(refs):
            error = self._read_mismatch(ref, owner, writable=index >= limit)
            if error is not None:
                raise error
        raise InvariantViolation("verify: fast path rejected refs that the slow path accepts")

    def is_current(self, ref: PageRef, owner: Owner) -> bool:
        """Whether ``owner`` may still read ``ref`` (``verify`` of one ref, as a bool)."""
        return self._read_mismatch(ref, owner, writable=False) is None

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` if the books disagree with themselves."""
        problems = self._structure_problems()
        free_ids = list(self._free)
        if len(set(free_ids)) != len(free_ids):
            problems.append("a page is listed twice in the free queue")
        problems += self._page_problems(set(free_ids))
        self._generations_at_last_check = list(self._generation)
        if problems:
            raise InvariantViolation("page pool: " + "; ".join(problems[:8]))

    # -- internals ----------------------------------------------------------------------------

    def _move(self, page_id: int, to: PageState) -> None:
        current = self._state[page_id]
        check_move(PAGE_TRANSITIONS, "page", str(page_id), current, to)
        self._state[page_id] = to
        self._counts[current] -= 1
        self._counts[to] += 1

    def _release(self, refs: Sequence[PageRef]) -> list[int]:
        target = PageState.PENDING_ZERO if self._zero_on_free else PageState.FREE
        to_zero: list[int] = []
        for ref in refs:
            page_id = ref.page_id
            self._move(page_id, target)
            self._owner[page_id] = None
            if target is PageState.FREE:
                self._free.append(page_id)
            else:
                to_zero.append(page_id)
        return to_zero

    def _check_refs(
        self, refs: Sequence[PageRef], owner: Owner, want: PageState, *, unique: bool
    ) -> None:
        seen: set[int] = set()
        for ref in refs:
            error = self._mismatch(ref, owner, want)
            if error is not None:
                raise error
            if unique and ref.page_id in seen:
                state = self._state[ref.page_id]
                raise InvalidTransition("page", str(ref.page_id), state, state, "listed twice")
            seen.add(ref.page_id)

    def _read_mismatch(
        self, ref: PageRef, owner: Owner, *, writable: bool
    ) -> IsolationError | None:
        shared = ref.page_id < self._num_pages and self._state[ref.page_id] is PageState.SHARED
        error = self._mismatch(ref, owner, PageState.SHARED if shared else PageState.OWNED)
        if error is None and shared and writable:
            return self._error(ref, owner, IsolationReason.READ_ONLY)
        return error

    def _mismatch(
        self, ref: PageRef, owner: Owner, want: PageState, *, reader: bool = True
    ) -> IsolationError | None:
        """Why ``ref`` is not ``owner``'s page in state ``want`` (for SHARED: one it reads, unless
        ``reader`` is off), or None."""
        page_id = ref.page_id
        if page_id >= self._num_pages:
            reason = IsolationReason.UNKNOWN_PAGE
            return IsolationError(owner.request_id, page_id, ref.generation, None, reason)
        if self._generation[page_id] != ref.generation:
            return self._error(ref, owner, IsolationReason.STALE_GENERATION)
        if self._state[page_id] is not want:
            return self._error(ref, owner, IsolationReason.WRONG_STATE)
        if want is PageState.SHARED:
            if reader and owner not in self._readers[page_id]:
                return self._error(ref, owner, IsolationReason.OWNER_MISMATCH)
        elif self._owner[page_id] != owner:
            return self._error(ref, owner, IsolationReason.OWNER_MISMATCH)
        return None

    def _error(self, ref: PageRef, owner: Owner, reason: IsolationReason) -> IsolationError:
        actual = self._generation[ref.page_id]
        return IsolationError(owner.request_id, ref.page_id, ref.generation, actual, reason)

    def _structure_problems(self) -> list[str]:
        problems: list[str] = []
        n = self._num_pages
        if not len(self._state) == len(self._generation) == len(self._owner) == n:
            problems.append("per-page arrays do not all have num_pages entries")
        if sum(self._counts.values()) != n:
            problems.append(f"state counts {dict(self._counts)} do not add up to {n}")
        if not self._zero_on_free and self._counts[PageState.PENDING_ZERO]:
            problems.append("pages pending zeroing although zero_on_free is off")
        return problems

    def _page_problems(self, free_set: set[int]) -> list[str]:
        problems: list[str] = []
        counts = {state: 0 for state in PageState}
        previous = self._generations_at_last_check
        for page_id in range(self._num_pages):
            state, generation = self._state[page_id], self._generation[page_id]
            counts[state] += 1
            held = state in _HELD
            if held != (self._owner[page_id] is not None):
                problems.append(f"page {page_id} is {state} but owner is {self._owner[page_id]}")
            if (state is PageState.FREE) != (page_id in free_set):
                problems.append(f"page {page_id} is {state}; in free queue: {page_id in free_set}")
            if held and generation < 1:
                problems.append(f"page {page_id} is {state} at generation {generation}")
            shared = state is PageState.SHARED
            if shared != (page_id in self._scope) or shared != (page_id in self._readers):
                problems.append(f"page {page_id} is {state}; scope {self._scope.get(page_id)}")
            if generation < previous[page_id]:
                problems.append(f"page {page_id} generation went back to {generation}")
        if counts != self._counts:
            problems.append(f"state counters {dict(self._counts)} != actual {counts}")
        return problems


def pages_needed(n_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``n_tokens`` tokens at ``page_size`` tokens per page."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    return -(-n_tokens // page_size)
