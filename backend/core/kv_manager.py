"""Which pages each request holds: taking them at admission, growing tables, giving them back.

The scheduler decides *who* runs; this class decides *which pages* they hold, over the one
``PagePool`` (vLLM v1's ``KVCacheManager`` over its ``BlockPool``, in miniature):

- ``Allocation.ON_DEMAND`` (the default): a request admitted to compute ``n`` tokens gets the
  pages for those ``n`` tokens; a decoding request gets one more page when its next position
  starts one (``grow``). When the pool has none, the scheduler preempts (see ``Scheduler``).
- ``Allocation.RESERVE``: every page for prompt + max_tokens at admission, so a running request
  never needs another and nothing is ever preempted (the engine's first design; kept for
  deployments that prefer it, and as the benchmark's baseline).

Every page leaves a request through ``release``, whatever the reason (finished, aborted, failed,
preempted): pages the runner may still be writing (the request is in the step in flight) are
quarantined until that step's ``postprocess`` and then released with bumped generations; the
others are freed at once. With zero_on_free, released pages are pending zero until the engine
zeroes them (``take_to_zero`` lists them for the next ``SchedulerOutput``) and only then
allocatable, so the pages a request gave back are never handed out, nor read, before zeroing.

Pure bookkeeping; not thread-safe (the engine loop calls it through the scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from backend.core.pages import Owner, PagePool, PageRef
from backend.core.request import Request


class Allocation(StrEnum):
    ON_DEMAND = "on_demand"
    RESERVE = "reserve"


class KVManager:
    def __init__(self, pool: PagePool, allocation: Allocation = Allocation.ON_DEMAND) -> None:
        self.pool = pool
        self.allocation = allocation
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
    def pages_coming(self) -> int:
        """Released pages this step's zeroing makes allocatable (0 without zero_on_free)."""
        return len(self._to_zero)

    @property
    def has_pending(self) -> bool:
        """Pages to zero or quarantined for the step in flight: the engine has work to do."""
        return bool(self._to_zero) or bool(self._step_quarantine)

    # -- taking pages ----------------------------------------------------------------------------

    def reserve(self, request: Request, *, headroom: int = 0) -> bool:
        """Give an admitted request its first pages, keeping ``headroom`` pages free; False
        (nothing changed) when the pool cannot now."""
        needed = self.pages_to_reserve(request)
        if self.pool.free_pages < needed + headroom:
            return False
        request.page_table = tuple(self.pool.allocate(needed, request.owner))
        return True

    def grow(self, request: Request) -> bool:
        """One more page for a decoding request's next position; False when none is free."""
        if self.pool.free_pages < 1:
            return False
        request.page_table += tuple(self.pool.allocate(1, request.owner))
        return True

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
        if refs and in_flight:
            # The runner may still be writing these pages for the step in flight.
            self.pool.quarantine(refs, request.owner)
            self._step_quarantine.append((request.owner, refs))
        elif refs:
            self._to_zero.extend(self.pool.free(refs, request.owner))
        request.page_table = ()

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
