"""Continuous-batching scheduler over a ``KVManager``: schedule -> (runner) -> postprocess.

Queues, each holding requests of exactly the states named (checked, never assumed):

1. ``add``: admission first, the one admission path of every role. A request whose prompt +
   max_tokens can never fit is REJECTED with its typed error and the error is raised; it never
   reaches a queue and the pool is never touched.
2. waiting (FIFO; WAITING, and PREEMPTED requests at the front in admission order): the head is
   admitted when ``max_running`` allows and the ``KVManager`` has its first pages (on demand:
   the pages for the tokens it computes now, keeping ``watermark`` pages free while others run);
   it then moves to running as PREFILLING. Nobody overtakes a head that does not fit yet.
3. running (PREFILLING, DECODING; in admission order): each step first gives every DECODING
   request whose next position starts a new page that page, then gives every DECODING request
   one token, then spends what is left of ``max_batch_tokens`` on prefill chunks, continuing
   PREFILLING requests before admitting new ones (continuous batching).
4. ``postprocess``: advances ``num_computed_tokens``, appends sampled tokens, moves PREFILLING to
   DECODING, finishes on a stop token (STOP) or at max_tokens (LENGTH) and releases the pages.
5. ``abort`` / ``fail``: ABORTED / FAILED from any live state. Pages of a request that is part of
   the step in flight (scheduled, not yet postprocessed) may still be written by the runner, so
   they are quarantined and released at that step's ``postprocess``; otherwise they are freed.
6. ``add_prefilled`` (decode role): a request whose prompt K/V was computed elsewhere and verified
   enters here AWAITING_KV, holding its prompt's pages, with its first token; it moves
   AWAITING_KV -> DECODING (joins running) or AWAITING_KV -> FINISHED (the first token ends it and
   its pages are freed). The role keeps such a request, and its pages, in its own queues until
   then, and returns pages through ``kv`` (``free_reserved`` / ``release_reserved_quarantine``)
   so that zeroing still goes out in ``SchedulerOutput.pages_to_zero``.

Preemption (on-demand allocation only), in this stated order: when a DECODING request needs a
page and none is free, nor coming from this step's zeroing, the running request admitted last is
preempted (LIFO; it may be the one asking), and again until a page is free or coming. Requests
that asked while pages are only coming sit out this step. A preempted request gives its pages
back through the one release path (``KVManager.release``: freed, generation bumped on reuse,
zeroed before reuse), keeps its output tokens, returns to the front of the waiting queue as
PREEMPTED, and when re-admitted recomputes prompt + outputs in one prefill that samples its next
token: its answer is the one it would have given unpreempted, never a truncation or an error. The
oldest running request is preempted only when it alone is left, so it always makes progress.

Recompute at a length (``recompute_past``: Phi-3's longrope, whose frequencies change once a
sequence is longer than ``original_max_position_embeddings``): a request whose KV was computed for
at most that many tokens and whose step would take it past them is preempted first, so that it is
recomputed whole, prompt and outputs, for its new length (transformers drops its cache there and
recomputes the same way); its answer is the model's, not a mix of two RoPE.

Not thread-safe: the engine loop calls everything, and applies aborts between its calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from backend.core.admission import CapacityLimits, admit
from backend.core.errors import (
    DuplicateRequestId,
    InvalidTransition,
    InvariantViolation,
    KvguardError,
    StepProtocolError,
)
from backend.core.kv_manager import Allocation, KVManager
from backend.core.messages import (
    DecodeItem,
    PrefillChunk,
    SchedulerOutput,
    StepResult,
    check_sampled,
)
from backend.core.pages import PagePool
from backend.core.prefix_cache import CacheScopes, PrefixCache
from backend.core.request import (
    WAITING_STATES,
    FinishReason,
    Request,
    RequestState,
    waiting_problems,
)

_RUNNING = frozenset({RequestState.PREFILLING, RequestState.DECODING})


class Scheduler:
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
        """``watermark``: pages a new admission leaves free while other requests run, so that
        decoding can grow without preempting the newcomer at once (default: 1% of the pool,
        at least one page). ``cache_scopes``: turns the prefix cache on, with these scopes."""
        if (limits.page_size, limits.pool_pages) != (pool.page_size, pool.num_pages):
            raise ValueError(
                f"limits ({limits.pool_pages} pages x {limits.page_size}) do not describe the "
                f"pool ({pool.num_pages} x {pool.page_size}); build them with "
                "CapacityLimits.from_pool"
            )
        if max_running < 1 or max_batch_tokens < max_running:
            raise ValueError(
                f"need 1 <= max_running <= max_batch_tokens (every decode takes a token), got "
                f"max_running={max_running}, max_batch_tokens={max_batch_tokens}"
            )
        self._pool = pool
        cache = None if cache_scopes is None else PrefixCache(pool, cache_scopes)
        self._kv = KVManager(pool, allocation, cache)
        self._watermark = max(1, pool.num_pages // 100) if watermark is None else watermark
        self._limits = limits
        self._max_batch_tokens = max_batch_tokens
        self._max_running = max_running
        self._eos_token_id = eos_token_id
        self._live: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._step = 0
        self._in_flight: SchedulerOutput | None = None
        self._in_flight_requests: set[Request] = set()
        self.num_preemptions = 0
        self._recompute_past = recompute_past

    # -- introspection ------------------------------------------------------------------------

    @property
    def pool(self) -> PagePool:
        return self._pool

    @property
    def kv(self) -> KVManager:
        return self._kv

    @property
    def limits(self) -> CapacityLimits:
        return self._limits

    @property
    def max_running(self) -> int:
        return self._max_running

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get(self, request_id: str) -> Request | None:
        """The live (non-terminal) request with this id, if any."""
        return self._live.get(request_id)

    def has_work(self) -> bool:
        """Whether the engine loop should call ``schedule`` (live requests or pages to zero)."""
        return bool(self._live) or self._kv.has_pending

    # -- lifecycle ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Admit ``request`` to the waiting queue, or mark it REJECTED and raise its error.

        Raises ``ContextLengthExceeded`` / ``InvalidRequest`` (admission) or
        ``DuplicateRequestId``; in every case the request is REJECTED and no page was reserved.
        This is the only admission path: a role with its own queues (decode) overrides
        ``_enqueue`` (where an admitted request waits) and ``get`` (which ids are live), never
        the checks.
        """
        if request.state is not RequestState.WAITING:
            raise InvalidTransition(
                "request",
                request.request_id,
                request.state,
                RequestState.WAITING,
                "only a new request can be added",
            )
        try:
            if self.get(request.request_id) is not None:
                raise DuplicateRequestId(request.request_id)
            admit(request.num_prompt_tokens, request.sampling.max_tokens, self._limits)
        except KvguardError as error:
            request.transition(RequestState.REJECTED, error)
            raise
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Where an admitted request waits for pages (the base: the waiting queue)."""
        self._live[request.request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """ABORT a live request and release its pages; None if no live request has this id.

        Idempotent: a request that is already terminal is no longer live, so nothing happens.
        """
        request = self._live.get(request_id)
        if request is None:
            return None
        self._release_pages(request, strict=True)
        request.transition(RequestState.ABORTED)
        self._forget(request)
        return request

    def fail(self, request_id: str, error: KvguardError) -> Request | None:
        """FAIL a live request with ``error``; None if no live request has this id.

        Releases only the pages the pool confirms the request still holds: a request may be
        failing precisely because a reference went stale, and such a page is not its to free.
        """
        request = self._live.get(request_id)
        if request is None:
            return None
        self._release_pages(request, strict=False)
        request.transition(RequestState.FAILED, error)
        self._forget(request)
        return request

    def add_prefilled(self, request: Request, first_token: int) -> StepResult:
        """Enter an AWAITING_KV request whose prompt K/V was written and verified elsewhere.

        The request must hold the pages ``KVManager.pages_to_reserve`` gives it (its prompt's, on
        demand), every page still its own at the generation it was given, and there must be a
        running slot; ``first_token`` is
        the token sampled at the end of the prompt. It then moves AWAITING_KV -> DECODING and
        joins the running batch, or AWAITING_KV -> FINISHED (STOP/LENGTH) with its pages freed.

        Raises ``InvalidTransition`` (not AWAITING_KV), ``DuplicateRequestId``,
        ``StepProtocolError`` (bad token), ``IsolationError`` (a page is no longer the request's)
        or ``InvariantViolation`` (partial page table, no running slot); on any refusal nothing
        changes and the caller still holds the request and its pages.
        """
        self._check_prefilled(request, first_token)
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_ids.append(first_token)
        reason = self._finish_reason(request, first_token)
        if reason is not None:
            self._release_pages(request, strict=True)
            request.transition(RequestState.FINISHED, finish_reason=reason)
        else:
            request.transition(RequestState.DECODING)
            self._live[request.request_id] = request
            self._running.append(request)
        return StepResult(request.request_id, first_token, request.state, request.finish_reason)

    def check_invariants(self, *, held_outside: int = 0, quarantined_outside: int = 0) -> None:
        """Raise ``InvariantViolation`` if queues, states, page tables and the pool disagree.

        ``held_outside`` / ``quarantined_outside``: pages a role holds or quarantines in its own
        queues (decode's AWAITING_KV reservations and drains), which the pool counts too.
        """
        self._pool.check_invariants()
        problems = [p for r in self._waiting for p in waiting_problems(r)]
        problems += [p for r in self._running for p in self._running_problems(r)]
        queued = [r.request_id for r in self._waiting] + [r.request_id for r in self._running]
        if len(queued) != len(set(queued)) or set(queued) != set(self._live):
            problems.append("live requests are not exactly waiting + running, once each")
        if len(self._running) > self._max_running:
            problems.append(f"{len(self._running)} running > max_running {self._max_running}")
        held = held_outside + sum(len(r.page_table) for r in self._running)
        owned, shared = self._pool.owned_pages, self._pool.shared_reads
        if owned + shared != held:
            problems.append(
                f"pool has {owned} owned pages + {shared} shared reads, tables hold {held}"
            )
        if self._kv.cache is not None:
            problems += self._kv.cache.check_invariants()
        quarantined = quarantined_outside + self._kv.step_quarantined
        if self._pool.quarantined_pages != quarantined:
            actual = self._pool.quarantined_pages
            problems.append(f"{actual} pages quarantined, the scheduler knows {quarantined}")
        if self._pool.pending_zero_pages < self._kv.pages_coming:
            problems.append("pages queued for zeroing are not pending zero in the pool")
        if problems:
            raise InvariantViolation("scheduler: " + "; ".join(problems[:8]))

    def fingerprint(self) -> tuple[object, ...]:
        """Queues, requests' progress and the KV books, hashable: two schedulers with equal
        fingerprints schedule the same futures (the model checker's state key; counters that
        only grow, like the step number, are left out)."""

        def books(r: Request) -> tuple[object, ...]:
            outputs = tuple(r.output_ids)
            return (
                r.request_id,
                r.state,
                r.page_table,
                r.num_computed_tokens,
                outputs,
                r.cached_upto,
            )

        queues = tuple(map(books, self._waiting)), tuple(map(books, self._running))
        return queues, self._kv.fingerprint()

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Must be followed by ``postprocess`` of the returned output."""
        if self._in_flight is not None:
            raise StepProtocolError(
                f"schedule() called while step {self._in_flight.step} awaits postprocess()"
            )
        budget = self._max_batch_tokens
        self._recompute_crossing()
        stalled = self._grow_decoders()
        decodes = self._schedule_decodes(stalled)
        budget -= len(decodes)
        prefills = self._schedule_prefills(budget)
        budget -= sum(chunk.num_tokens for chunk in prefills)
        prefills += self._admit_waiting(budget)
        self._step += 1
        output = SchedulerOutput(
            self._step, tuple(decodes), tuple(prefills), self._kv.take_to_zero()
        )
        self._in_flight = output
        self._in_flight_requests = {item.request for item in decodes}
        self._in_flight_requests.update(chunk.request for chunk in prefills)
        return output

    def postprocess(
        self, output: SchedulerOutput, sampled: Mapping[str, int | None]
    ) -> list[StepResult]:
        """Apply the runner's sampled tokens (``{request_id: token}``; None or absent for chunks
        that do not end a prompt). Requests that became terminal during the step are skipped.

        Returns one ``StepResult`` per sampled token, decodes first, in output order.
        """
        if output is not self._in_flight:
            raise StepProtocolError("postprocess() of an output that is not the step in flight")
        check_sampled(output, sampled)
        self._in_flight = None
        self._in_flight_requests = set()
        results: list[StepResult] = []
        for item in output.decodes:
            if item.request.state is RequestState.DECODING:
                results.append(self._append_token(item.request, 1, sampled))
        for chunk in output.prefills:
            request = chunk.request
            if request.state is not RequestState.PREFILLING:
                continue
            if chunk.samples:
                results.append(self._append_token(request, chunk.num_tokens, sampled))
            else:
                request.num_computed_tokens += chunk.num_tokens
                self._kv.publish(request)
        self._kv.release_step_quarantine()
        return results

    # -- scheduling phases --------------------------------------------------------------------

    def _grow_decoders(self) -> set[Request]:
        """Give each DECODING request whose next position starts a page that page, oldest
        first; preempt (LIFO) when none is free or coming. Returns the requests that sit out
        this step because their page is only coming (this step's zeroing frees it)."""
        stalled: set[Request] = set()
        for request in list(self._running):
            if request.state is not RequestState.DECODING or request not in self._running:
                continue
            while self._kv.needs_page(request) and not self._kv.grow(request):
                if self._kv.pages_coming > len(stalled):
                    stalled.add(request)
                    break
                victim = self._running[-1]
                stalled.discard(victim)
                self._preempt(victim)
                if victim is request:
                    break
        return stalled

    def _recompute_crossing(self) -> None:
        """Preempt the running requests whose next step crosses ``recompute_past`` with KV
        computed below it (see the module docstring)."""
        limit = self._recompute_past
        if limit is None:
            return
        for request in list(self._running):
            computed = request.num_computed_tokens
            if 0 < computed <= limit < self._step_end(request, computed):
                self._preempt(request)

    def _step_end(self, request: Request, computed: int) -> int:
        """Tokens with KV after the request's next step, if given the whole batch."""
        if request.state is RequestState.DECODING:
            return computed + 1
        return min(request.num_tokens, computed + self._max_batch_tokens)

    def _preempt(self, request: Request) -> None:
        self._kv.release(request, in_flight=False, strict=True)
        request.num_computed_tokens = 0
        request.preemptions += 1
        self.num_preemptions += 1
        request.transition(RequestState.PREEMPTED)
        self._running.remove(request)
        self._waiting.appendleft(request)

    def _schedule_decodes(self, stalled: set[Request]) -> list[DecodeItem]:
        decodes: list[DecodeItem] = []
        for request in self._running:
            if request.state not in _RUNNING:
                raise InvariantViolation(f"{request!r} is in the running queue")
            if request.state is RequestState.DECODING and request not in stalled:
                position = request.num_computed_tokens
                decodes.append(
                    DecodeItem(request, position, request.output_ids[-1], request.page_table)
                )
        return decodes

    def _schedule_prefills(self, budget: int) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        for request in self._running:
            if budget <= 0:
                break
            if request.state is RequestState.PREFILLING:
                chunk = self._chunk(request, budget)
                chunks.append(chunk)
                budget -= chunk.num_tokens
        return chunks

    def _admit_waiting(self, budget: int) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        while self._waiting and budget > 0 and self._slots_in_use() < self._max_running:
            request = self._waiting[0]
            if request.state not in WAITING_STATES:
                raise InvariantViolation(f"{request!r} is in the waiting queue")
            headroom = self._watermark if self._running else 0
            if not self._kv.reserve(request, headroom=headroom):
                break
            request.transition(RequestState.PREFILLING)
            self._waiting.popleft()
            self._running.append(request)
            chunk = self._chunk(request, budget)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks

    def _slots_in_use(self) -> int:
        """Requests that count against ``max_running`` (a role adds its own: decode's awaiting)."""
        return len(self._running)

    @staticmethod
    def _chunk(request: Request, budget: int) -> PrefillChunk:
        start, total = request.num_computed_tokens, request.num_tokens
        end = min(total, start + budget)
        return PrefillChunk(request, start, end, request.page_table, total)

    # -- postprocess phases -------------------------------------------------------------------

    def _append_token(
        self, request: Request, n_tokens: int, sampled: Mapping[str, int | None]
    ) -> StepResult:
        token = sampled.get(request.request_id)
        if token is None:  # _check_sampled refused this already; kept for the type checker
            raise StepProtocolError(f"no token for {request.request_id!r}")
        request.num_computed_tokens += n_tokens
        self._kv.publish(request)  # before a finish releases them: a later turn reuses them
        request.output_ids.append(token)
        reason = self._finish_reason(request, token)
        if reason is not None:
            self._release_pages(request, strict=True)
            request.transition(RequestState.FINISHED, finish_reason=reason)
            self._forget(request)
        elif request.state is RequestState.PREFILLING:
            request.transition(RequestState.DECODING)
        return StepResult(request.request_id, token, request.state, request.finish_reason)

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        if token == self._eos_token_id or token in request.sampling.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_ids) >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def _check_prefilled(self, request: Request, first_token: int) -> None:
        if request.state is not RequestState.AWAITING_KV:
            raise InvalidTransition(
                "request",
                request.request_id,
                request.state,
                RequestState.DECODING,
                "only a request awaiting KV can enter prefilled",
            )
        if request.request_id in self._live:
            raise DuplicateRequestId(request.request_id)
        if isinstance(first_token, bool) or not isinstance(first_token, int) or first_token < 0:
            raise StepProtocolError(f"first token for {request.request_id!r} is not a token id")
        if request.num_computed_tokens or request.output_ids:
            raise InvariantViolation(f"prefilled {request!r} already has progress")
        if len(request.page_table) != self._kv.pages_to_reserve(request):
            raise InvariantViolation(f"prefilled {request!r} holds a partial page table")
        self._pool.verify(request.page_table, request.owner)
        if len(self._running) >= self._max_running:
            raise InvariantViolation(
                f"no running slot for prefilled {request!r} (max_running {self._max_running})"
            )

    # -- invariants ---------------------------------------------------------------------------

    def _running_problems(self, request: Request) -> list[str]:
        if request.state not in _RUNNING:
            return [f"{request!r} is in the running queue"]
        computed, outputs = request.num_computed_tokens, request.num_output_tokens
        if request.state is RequestState.PREFILLING:
            need = request.num_tokens
            consistent = outputs < request.sampling.max_tokens and 0 <= computed < need
        else:
            need = computed
            consistent = (
                1 <= outputs < request.sampling.max_tokens and computed == request.num_tokens - 1
            )
        problems = self._kv.table_problems(request, need)
        if not consistent:
            problems.append(f"{request!r} progress does not match its state")
        return problems

    # -- pages and queues ---------------------------------------------------------------------

    def _release_pages(self, request: Request, *, strict: bool) -> None:
        in_flight = request in self._in_flight_requests
        self._kv.release(request, in_flight=in_flight, strict=strict)

    def _forget(self, request: Request) -> None:
        del self._live[request.request_id]
        if request in self._running:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
