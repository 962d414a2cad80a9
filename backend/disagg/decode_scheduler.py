"""The decode role's scheduler: the engine's ``Scheduler`` plus the queues in front of it.

Lifecycle of a request on decode, as queues (each holds requests of exactly the states named):

1. ``add`` (the base's, the one admission path): admission against this engine's own limits (the
   cross-role limit was applied by the caller before); a request that can never fit is REJECTED
   and raises, reserving nothing. Admitted, it is queued here by ``_enqueue``.
2. kv_waiting (FIFO, WAITING): ``reserve_ready`` gives the head the pages for its prompt (the
   ``KVManager``'s reservation: the prompt's pages on demand, prompt + max_tokens with RESERVE)
   and a running slot, then it is AWAITING_KV. Nobody overtakes a head that does not fit. Decoding
   grows the table page by page in the base scheduler, which may preempt a DECODING request (it
   then recomputes its tokens here, locally); an AWAITING_KV request is never preempted: prefill
   may be writing into its pages.
3. awaiting (AWAITING_KV): the pages are held but unreadable by intent: no step schedules them.
   ``accept`` moves a request whose KV was verified to DECODING (the base scheduler's running
   queue, through ``Scheduler.add_prefilled``) or straight to FINISHED when the first token ends
   it. ``end_awaiting`` makes it terminal and hands its page references to the caller, who
   decides between freeing and quarantine.
4. draining: pages quarantined after an abort or a lost handoff, until ``release_drain``, which
   bumps their generations and frees them (zeroing them with zero_on_free).
5. running (DECODING): the base ``Scheduler`` steps them exactly as in the unified engine.

Decode runs without a prefix cache: every prompt's K/V arrives from prefill into fresh pages (a
prefill role keeps its own tenant-scoped cache). A subclass only so the engine core can drive it as
its ``Scheduler``; it uses the base's public API alone (``add_prefilled``, its ``kv`` manager to
give pages back, the pool, and ``check_invariants`` told what these queues hold), so the base's
queues stay the base's. Pure bookkeeping.
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum

from backend.core.admission import CapacityLimits
from backend.core.errors import (
    InvariantViolation,
    KvguardError,
)
from backend.core.kv_manager import Allocation
from backend.core.messages import StepResult
from backend.core.pages import Owner, PagePool, PageRef
from backend.core.prefix_cache import CacheScopes
from backend.core.request import Request, RequestState, waiting_problems
from backend.core.scheduler import Scheduler


class Release(StrEnum):
    """How the pages of a request that ends while awaiting KV leave it."""

    FREE = "free"  # no write can reach them (nothing was sent, or prefill is quiescent)
    DRAIN = "drain"  # a write may still land: quarantine until release_drain


class DecodeScheduler(Scheduler):
    def __init__(
        self,
        pool: PagePool,
        limits: CapacityLimits,
        *,
        max_batch_tokens: int,
        max_running: int,
        eos_token_id: int | None = None,
        allocation: Allocation = Allocation.ON_DEMAND,
        watermark: int | None = None,
        cache_scopes: CacheScopes | None = None,
        recompute_past: int | None = None,
    ) -> None:
        if cache_scopes is not None:
            raise ValueError("the decode role runs without a prefix cache")
        super().__init__(
            pool,
            limits,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            eos_token_id=eos_token_id,
            allocation=allocation,
            watermark=watermark,
            recompute_past=recompute_past,
        )
        self._kv_waiting: deque[Request] = deque()
        self._awaiting: dict[str, Request] = {}
        self._draining: dict[str, tuple[Owner, tuple[PageRef, ...]]] = {}

    # -- introspection ------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._kv_waiting)

    @property
    def num_awaiting(self) -> int:
        return len(self._awaiting)

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    def awaiting(self, request_id: str) -> Request | None:
        return self._awaiting.get(request_id)

    def get(self, request_id: str) -> Request | None:
        found = super().get(request_id) or self._awaiting.get(request_id)
        if found is None:
            found = next((r for r in self._kv_waiting if r.request_id == request_id), None)
        return found

    # -- 1. admission -------------------------------------------------------------------------

    def _enqueue(self, request: Request) -> None:
        """Admitted by ``Scheduler.add`` (the one admission path): wait for pages for the KV."""
        self._kv_waiting.append(request)

    # -- 2. reservation -----------------------------------------------------------------------

    def reserve_ready(self) -> list[Request]:
        """Reserve pages for waiting requests, FIFO; returns the ones now AWAITING_KV."""
        reserved: list[Request] = []
        while self._kv_waiting:
            request = self._kv_waiting[0]
            if self._slots_in_use() >= self.max_running:
                break
            if not self.kv.reserve(request):
                break
            request.transition(RequestState.AWAITING_KV)
            self._kv_waiting.popleft()
            self._awaiting[request.request_id] = request
            reserved.append(request)
        return reserved

    def abort_waiting(self, request_id: str) -> Request | None:
        """ABORT a request that holds no pages yet; None if none is waiting under this id."""
        for request in self._kv_waiting:
            if request.request_id == request_id:
                self._kv_waiting.remove(request)
                request.transition(RequestState.ABORTED)
                return request
        return None

    # -- 3. the handoff's end -----------------------------------------------------------------

    def accept(self, request_id: str, first_token: int) -> StepResult:
        """KV verified: the prompt is computed and ``first_token`` is the first output.

        If the base refuses the entry (a page went stale, a bad token), the request stays
        awaiting with its pages, so the caller can still end it with ``end_awaiting``.
        """
        request = self._awaiting_request(request_id)
        result = self.add_prefilled(request, first_token)
        del self._awaiting[request_id]
        return result

    def end_awaiting(
        self,
        request_id: str,
        to: RequestState,
        error: KvguardError | None = None,
        *,
        release: Release,
    ) -> Request:
        """Make an AWAITING_KV request terminal and release its pages as ``release`` says.

        FREE returns them to the pool now, DRAIN quarantines them (unreadable, unallocatable)
        until ``release_drain``. Either way the request's table is emptied.
        """
        request = self._take_awaiting(request_id)
        request.transition(to, error)
        refs, request.page_table = request.page_table, ()
        if release is Release.FREE:
            self.kv.free_reserved(refs, request.owner)
        else:
            self.pool.quarantine(refs, request.owner)
            self._draining[request_id] = (request.owner, refs)
        return request

    def is_draining(self, request_id: str) -> bool:
        return request_id in self._draining

    def release_drain(self, request_id: str) -> int:
        """Bump generations and free; returns how many pages left quarantine."""
        owner, refs = self._draining.pop(request_id)
        self.kv.release_reserved_quarantine(refs, owner)
        return len(refs)

    # -- checks -------------------------------------------------------------------------------

    def check_invariants(self, *, held_outside: int = 0, quarantined_outside: int = 0) -> None:
        """The base's checks, told about the pages these queues hold, plus the queues' own."""
        problems = [p for r in self._kv_waiting for p in waiting_problems(r)]
        problems += [p for r in self._awaiting.values() for p in self._awaiting_problems(r)]
        if self._slots_in_use() > self.max_running:
            problems.append("more running + awaiting requests than max_running")
        if problems:
            raise InvariantViolation("decode scheduler: " + "; ".join(problems[:8]))
        super().check_invariants(
            held_outside=held_outside + sum(len(r.page_table) for r in self._awaiting.values()),
            quarantined_outside=quarantined_outside
            + sum(len(refs) for _, refs in self._draining.values()),
        )

    def _awaiting_problems(self, request: Request) -> list[str]:
        if request.state is not RequestState.AWAITING_KV:
            return [f"{request!r} is in the awaiting queue"]
        return self.kv.table_problems(request, request.num_tokens)

    def _slots_in_use(self) -> int:
        return self.num_running + len(self._awaiting)

    def _awaiting_request(self, request_id: str) -> Request:
        request = self._awaiting.get(request_id)
        if request is None:
            raise InvariantViolation(f"request {request_id!r} is not awaiting KV")
        return request

    def _take_awaiting(self, request_id: str) -> Request:
        request = self._awaiting_request(request_id)
        del self._awaiting[request_id]
        return request
