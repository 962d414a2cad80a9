"""Which pages each request holds: taking them at admission, growing tables, giving them back.

The scheduler decides *who* runs; this class decides *which pages* they hold, over the one
``PagePool`` (vLLM v1's ``KVCacheManager`` over its ``BlockPool``, in miniature):

- ``Allocation.ON_DEMAND`` (the default): a request admitted to compute ``n`` tokens gets the
  pages for those ``n`` tokens; a decoding request gets one more page when its next position
  starts one (``grow``). When the pool has none, the scheduler preempts (see ``Scheduler``).
- ``Allocation.RESERVE``: every page for prompt + max_tokens at admission, so a running request
  never needs another and nothing is ever preempted (the engine's first design; kept for
  deployments that prefer it, and as the benchmark's baseline).

With a ``PrefixCache`` (unified and prefill roles, unless ``prefix_cache`` is off), ``reserve``
first reads the cached pages that hold the start of the request's tokens (its own scope's only)
and takes new pages for the rest; ``publish`` after each step shares the pages that became full;
when pages run short, idle cached pages are evicted before anyone is preempted.

Every page leaves a request through ``release``, whatever the reason (finished, aborted, failed,
preempted): cached pages it reads are unshared (a cached page is released, and zeroed, only when the
cache evicts it with no reader left); its own pages the runner may still be writing (the request is
in the step in flight) are quarantined until that step's ``postprocess`` and then released with
bumped generations; the others are freed at once. With zero_on_free, released pages are pending zero
until the engine zeroes them (``take_to_zero`` lists them for the next ``SchedulerOutput``) and only
then allocatable, so the pages a request gave back are never handed out, nor read, before zeroing.

Pure bookkeeping; not thread-safe (the engine loop calls it through the scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from backend.core.pages import Owner, PagePool, PageRef, PageState
from backend.core.prefix_cache import PrefixCache
from backend.core.request import Request


class Allocation(StrEnum):
    ON_DEMAND = "on_demand"
    RESERVE = "reserve"


class KVManager:
    def __init__(
        self,
        pool: PagePool,
        allocation: Allocation = Allocation.ON_DEMAND,
        cache: PrefixCache | None = None,
    ) -> None:
        self.pool = pool
        self.allocation = allocation
        self.cache = cache
        self._to_zero: list[int] = []
        self._step_quarantine: list[tuple[Owner, tuple[PageRef, ...]]] = []

    # -- how many pages --------------------------------------------------------------------------

    def pages_to_reserve(self, request: Request) -> int:
        """Pages a request takes when admitted: its tokens so far (ON_DEMAND) or its whole
        prompt + max_tokens (RESERVE)."""
        if self.allocation is Allocation.RESERVE:
            return self.pool.pages_for(request.max_total_tokens)
        return self.pool.pages_for(request.num_tokens)

    def needs_page(self, request: Request) -> bool:
        """Whether the position the request writes next lies beyond its page table."""
        return len(request.page_table) * self.pool.page_size <= request.num_computed_tokens

    @property
    def available_pages(self) -> int:
        """Pages a new request can have: free ones and idle cached ones (evicted on demand)."""
        idle = self.cache.idle_pages if self.cache is not None else 0
        return self.pool.free_pages + idle

    @property
    def pages_coming(self) -> int:
        """Released pages this step's zeroing makes allocatable (0 without zero_on_free)."""
        return len(self._to_zero)

    @property
    def has_pending(self) -> bool:
        """Pages to zero or quarantined for the step in flight: the engine has work to do."""
        return bool(self._to_zero) or bool(self._step_quarantine)

    # -- taking pages ----------------------------------------------------------------------------

    def reserve(self, request: Request, *, headroom: int = 0) -> bool:
        """Give an admitted request its first pages (cache hits, then new ones), keeping
        ``headroom`` pages free; False (nothing taken) when the pool cannot now."""
        hits = self.cache.lookup(request) if self.cache is not None else []
        needed = self.pages_to_reserve(request) - len(hits)
        if not self._room_for(needed + headroom, keep=hits):
            return False
        if self.cache is not None:
            self.cache.acquire(request, hits)
        request.page_table = (*hits, *self.pool.allocate(needed, request.owner))
        request.num_computed_tokens = len(hits) * self.pool.page_size
        request.cached_upto = len(hits)
        return True

    def grow(self, request: Request) -> bool:
        """One more page for a decoding request's next position; False when none is free."""
        if not self._room_for(1):
            return False
        request.page_table += tuple(self.pool.allocate(1, request.owner))
        return True

    def publish(self, request: Request) -> None:
        """After a step: share the request's pages that became full of computed K/V."""
        if self.cache is not None:
            self.cache.publish(request)

    def _room_for(self, n: int, *, keep: Sequence[PageRef] = ()) -> bool:
        """Whether ``n`` pages are free; if not, evict idle cached pages towards it first (with
        zero_on_free they come free after this step's zeroing: ``pages_coming``)."""
        short = n - self.pool.free_pages - self.pages_coming
        if short > 0 and self.cache is not None:
            self._to_zero.extend(self.cache.evict(short, keep=keep))
        return self.pool.free_pages >= n

    # -- giving pages back -----------------------------------------------------------------------

    def release(self, request: Request, *, in_flight: bool, strict: bool) -> None:
        """Empty the request's page table through the one release path.

        ``strict``: every reference must still be the request's (a bug otherwise); without it,
        only the pages the pool confirms are released (a request may be failing precisely
        because a reference went stale, and such a page is not its to free).
        """
        refs = request.page_table
        if not strict:
            refs = tuple(ref for ref in refs if self.pool.is_current(ref, request.owner))
        shared = [r for r in refs if self.pool.state(r.page_id) is PageState.SHARED]
        if shared:
            assert self.cache is not None, "a shared page without a prefix cache"
            self.cache.release(request, shared)  # read-only: nothing can be writing them
            refs = tuple(r for r in refs if self.pool.state(r.page_id) is not PageState.SHARED)
        if refs and in_flight:
            # The runner may still be writing these pages for the step in flight.
            self.pool.quarantine(refs, request.owner)
            self._step_quarantine.append((request.owner, refs))
        elif refs:
            self._to_zero.extend(self.pool.free(refs, request.owner))
        request.page_table = ()
        request.cached_upto = 0

    def release_step_quarantine(self) -> None:
        """The step in flight is over: release what it kept in quarantine (generations bump)."""
        for owner, refs in self._step_quarantine:
            self._to_zero.extend(self.pool.release_quarantined(refs, owner))
        self._step_quarantine.clear()

    def free_reserved(self, refs: Sequence[PageRef], owner: Owner) -> None:
        """Free pages a role holds outside the scheduler's queues (no write can reach them)."""
        self._to_zero.extend(self.pool.free(refs, owner))

    def release_reserved_quarantine(self, refs: Sequence[PageRef], owner: Owner) -> None:
        """Release pages a role quarantined outside the scheduler's queues (generations bump)."""
        self._to_zero.extend(self.pool.release_quarantined(refs, owner))

    def take_to_zero(self) -> tuple[int, ...]:
        """Pages released since the last call, for this step's ``SchedulerOutput``."""
        pages = tuple(self._to_zero)
        self._to_zero.clear()
        return pages

    # -- invariants ------------------------------------------------------------------------------

    def fingerprint(self) -> tuple[object, ...]:
        """Pool, cache and pages to zero, hashable (the model checker's state key)."""
        cache = None if self.cache is None else self.cache.fingerprint()
        quarantine = tuple((owner.request_id, refs) for owner, refs in self._step_quarantine)
        return self.pool.fingerprint(), cache, tuple(self._to_zero), quarantine

    @property
    def step_quarantined(self) -> int:
        return sum(len(refs) for _, refs in self._step_quarantine)

    def table_problems(self, request: Request, need_tokens: int) -> list[str]:
        """What is wrong with a live request's table: it must cover ``need_tokens`` (the K/V
        written so far, or about to be) and no more than ``pages_to_reserve`` allows, every page
        still the request's."""
        pool, table = self.pool, request.page_table
        low, high = pool.pages_for(need_tokens), self.pages_to_reserve(request)
        if self.allocation is Allocation.RESERVE:
            low = high
        if not low <= len(table) <= high:
            return [f"{request!r} holds {len(table)} pages, not {low}..{high}"]
        if not all(pool.is_current(ref, request.owner) for ref in table):
            return [f"{request!r} holds a page reference the pool does not confirm"]
        return []
