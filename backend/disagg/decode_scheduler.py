"""The decode role's scheduler: the engine's ``Scheduler`` plus the queues in front of it.

Lifecycle of a request on decode, as queues (each holds requests of exactly the states named):

1. ``add``: admission against this engine's own limits (the cross-role limit was applied by the
   caller before); a request that can never fit is REJECTED and raises, reserving nothing.
2. kv_waiting (FIFO, WAITING): ``reserve_ready`` gives the head every page for prompt +
   max_tokens and a running slot, then it is AWAITING_KV. Nobody overtakes a head that does not fit.
3. awaiting (AWAITING_KV): the pages are held but unreadable by intent: no step schedules them.
   ``accept`` moves a request whose KV was verified to DECODING (the base scheduler's running
   queue) or straight to FINISHED when the first token ends it. ``end_awaiting`` makes it terminal
   and hands its page references to the caller, who decides between freeing and quarantine.
4. draining: pages quarantined after an abort or a lost handoff, until ``release_drain``, which
   bumps their generations and frees them (zeroing them with zero_on_free).
5. running (DECODING): the base ``Scheduler`` steps them exactly as in the unified engine.

Why a subclass that touches the base's queues: the base has no public way to enter a request
whose prompt KV came from elsewhere. The seam used is small (``_live``, ``_running``,
``_max_running``, ``_to_zero``, the per-request invariant helpers); if ``Scheduler`` grows an
``add_prefilled`` entry point this class shrinks to the handoff queues. Pure bookkeeping.
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum

from backend.core.admission import CapacityLimits, admit
from backend.core.errors import (
    DuplicateRequestId,
    InvalidTransition,
    InvariantViolation,
    KvguardError,
)
from backend.core.messages import StepResult
from backend.core.pages import Owner, PagePool, PageRef
from backend.core.request import Request, RequestState
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
    ) -> None:
        super().__init__(
            pool,
            limits,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            eos_token_id=eos_token_id,
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
        found = self._live.get(request_id) or self._awaiting.get(request_id)
        if found is None:
            found = next((r for r in self._kv_waiting if r.request_id == request_id), None)
        return found

    # -- 1. admission -------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.state is not RequestState.WAITING:
            raise InvalidTransition(
                "request", request.request_id, request.state, RequestState.WAITING, "not new"
            )
        try:
            if self.get(request.request_id) is not None:
                raise DuplicateRequestId(request.request_id)
            admit(request.num_prompt_tokens, request.sampling.max_tokens, self._limits)
        except KvguardError as error:
            request.transition(RequestState.REJECTED, error)
            raise
        self._kv_waiting.append(request)

    # -- 2. reservation -----------------------------------------------------------------------

    def reserve_ready(self) -> list[Request]:
        """Reserve pages for waiting requests, FIFO; returns the ones now AWAITING_KV."""
        reserved: list[Request] = []
        while self._kv_waiting:
            request = self._kv_waiting[0]
            if len(self._running) + len(self._awaiting) >= self._max_running:
                break
            needed = self._pool.pages_for(request.max_total_tokens)
            if needed > self._pool.free_pages:
                break
            request.page_table = tuple(self._pool.allocate(needed, request.owner))
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
        """KV verified: the prompt is computed and ``first_token`` is the first output."""
        request = self._take_awaiting(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_ids.append(first_token)
        reason = self._finish_reason(request, first_token)
        if reason is not None:
            self._to_zero.extend(self._pool.free(request.page_table, request.owner))
            request.page_table = ()
            request.transition(RequestState.FINISHED, finish_reason=reason)
        else:
            request.transition(RequestState.DECODING)
            self._live[request.request_id] = request
            self._running.append(request)
        return StepResult(request_id, first_token, request.state, request.finish_reason)

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
            self._to_zero.extend(self._pool.free(refs, request.owner))
        else:
            self._pool.quarantine(refs, request.owner)
            self._draining[request_id] = (request.owner, refs)
        return request

    def is_draining(self, request_id: str) -> bool:
        return request_id in self._draining

    def release_drain(self, request_id: str) -> int:
        """Bump generations and free; returns how many pages left quarantine."""
        owner, refs = self._draining.pop(request_id)
        self._to_zero.extend(self._pool.release_quarantined(refs, owner))
        return len(refs)

    # -- checks -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self._pool.check_invariants()
        problems = [p for r in self._kv_waiting for p in self._waiting_problems(r)]
        problems += [p for r in self._running for p in self._running_problems(r)]
        problems += [p for r in self._awaiting.values() for p in self._awaiting_problems(r)]
        if set(self._live) != {r.request_id for r in self._running}:
            problems.append("live requests are not exactly the running ones")
        if len(self._running) + len(self._awaiting) > self._max_running:
            problems.append("more running + awaiting requests than max_running")
        held = sum(len(r.page_table) for r in [*self._running, *self._awaiting.values()])
        if self._pool.owned_pages != held:
            problems.append(f"pool has {self._pool.owned_pages} owned pages, tables hold {held}")
        quarantined = sum(len(refs) for _, refs in self._draining.values())
        quarantined += sum(len(refs) for _, refs in self._step_quarantine)
        if self._pool.quarantined_pages != quarantined:
            problems.append(f"{self._pool.quarantined_pages} quarantined, known {quarantined}")
        if problems:
            raise InvariantViolation("decode scheduler: " + "; ".join(problems[:8]))

    def _awaiting_problems(self, request: Request) -> list[str]:
        if request.state is not RequestState.AWAITING_KV:
            return [f"{request!r} is in the awaiting queue"]
        if len(request.page_table) != self._pool.pages_for(request.max_total_tokens):
            return [f"{request!r} holds a partial page table"]
        if not all(self._pool.is_current(ref, request.owner) for ref in request.page_table):
            return [f"{request!r} holds a page reference the pool does not confirm"]
        return []

    def _take_awaiting(self, request_id: str) -> Request:
        request = self._awaiting.pop(request_id, None)
        if request is None:
            raise InvariantViolation(f"request {request_id!r} is not awaiting KV")
        return request
