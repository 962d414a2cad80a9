"""The engine loop on its own thread, and the asyncio face the HTTP server talks to.

Lifecycle of a request through this module:

1. ``submit`` (event loop): admission against the immutable limits, so a request that can never
   fit fails here with ``ContextLengthExceeded`` before anything is queued or reserved.
2. The request goes into the inbox; the engine thread drains the inbox between steps and calls
   ``EngineCore.add`` (admission again: the second line) or ``abort``.
3. Each step's results are posted back to the requests' ``Generation``s on the event loop in one
   batch: one wake-up of the loop per engine step for all of its requests (``_flush``), not one
   per request per step.
4. The request ends with exactly one terminal event (FINISHED, ABORTED, FAILED or REJECTED,
   with its error). A consumer that goes away (client disconnect, cancellation) aborts the
   request, which releases its pages.

If the loop itself fails (an error no step, call or admission catches: a CUDA or out-of-memory
error in a forward pass, staging or zeroing), the core's pages and requests are in a state nobody
can vouch for, so the engine serves nothing more: every request ends with ``EngineFailed``, new
ones are refused with it, and ``failed`` says why (the server's health and capacity report it, so
the gateway stops routing here and an orchestrator's health check can restart the process).

Roles with a handoff also ``post`` work to the engine thread (a handoff result arrived, a drain
ended): the callable runs between steps, and the ``StepOutcome`` it returns is delivered like a
step's. The loop also wakes for the core's timers (``next_wakeup`` -> ``tick``), so a deadline
is honoured even when no request arrives. Any event may carry the request's ``HandoffProof``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from backend.core.admission import CapacityLimits, admit
from backend.core.errors import KvguardError
from backend.core.messages import TokenLogprobs
from backend.core.request import FinishReason, Request, RequestState, SamplingParams
from backend.engine.core import EngineCore, StepOutcome
from contracts.engine import HandoffProof

log = logging.getLogger("kvguard.engine")


@dataclass(frozen=True, slots=True)
class EngineEvent:
    token: int | None = field(repr=False)
    state: RequestState
    finish_reason: FinishReason | None = None
    error: KvguardError | None = None
    proof: HandoffProof | None = None
    logprobs: TokenLogprobs | None = field(default=None, repr=False)  # when the request asked

    @property
    def is_terminal(self) -> bool:
        return self.finish_reason is not None


class Generation:
    """One request's event stream. Iterate it; leaving early (or ``abort``) aborts the request."""

    def __init__(self, engine: AsyncEngine, request: Request) -> None:
        self._engine = engine
        self.request = request
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._done = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def _post(self, event: EngineEvent) -> None:
        self._queue.put_nowait(event)

    async def events(self) -> AsyncIterator[EngineEvent]:
        try:
            while not self._done:
                event = await self._queue.get()
                self._done = event.is_terminal
                yield event
        finally:
            if not self._done:
                self.abort()

    def abort(self) -> None:
        self._done = True
        self._engine.abort(self.request_id)


@dataclass(slots=True)
class _Inbox:
    adds: deque[tuple[Request, Generation]] = field(default_factory=deque)
    aborts: deque[str] = field(default_factory=deque)
    calls: deque[Callable[[], StepOutcome | None]] = field(default_factory=deque)


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        limits: CapacityLimits,
        *,
        on_step: Callable[[StepOutcome], None] | None = None,
    ) -> None:
        self.core = core
        self.limits = limits
        self._on_step = on_step
        self._inbox = _Inbox()
        self._wake = threading.Condition()
        self._generations: dict[str, Generation] = {}
        self._outbox: list[tuple[Generation, EngineEvent]] = []  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failed: EngineFailed | None = None  # set once, by the engine thread

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvguard-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    def submit(
        self, *, request_id: str, tenant: str, prompt_ids: list[int], sampling: SamplingParams
    ) -> Generation:
        """Admission first (raises KvguardError), then queue the request for the engine thread."""
        admit(len(prompt_ids), sampling.max_tokens, self.limits)
        request = Request(request_id, tenant, prompt_ids, sampling)
        generation = Generation(self, request)
        with self._wake:
            if self.failed is not None:
                raise EngineFailed(self.failed.problem)
            if self._stopping:
                raise EngineStopping()
            self._inbox.adds.append((request, generation))
            self._wake.notify()
        return generation

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._inbox.aborts.append(request_id)
            self._wake.notify()

    def post(self, call: Callable[[], StepOutcome | None]) -> None:
        """Run ``call`` on the engine thread between steps; its outcome is delivered."""
        with self._wake:
            self._inbox.calls.append(call)
            self._wake.notify()

    def call_soon_on_loop(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the event loop (how the engine thread notifies the server)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed: the server is gone
            log.debug("dropped a notification for a closed loop")

    # -- engine-thread side ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # the core can no longer be trusted: serve nothing more
            log.exception("the engine loop failed; every request ends and none is taken")
            self._fail(EngineFailed(type(exc).__name__))
            return
        self._abort_everything()
        self._flush()

    def _serve(self) -> None:
        """Until ``stop``: take the inbox, run posted calls and timers, step."""
        while True:
            with self._wake:
                self._wait_for_work()
                if self._stopping:
                    break
                adds, aborts = list(self._inbox.adds), list(self._inbox.aborts)
                calls = list(self._inbox.calls)
                self._inbox.adds.clear()
                self._inbox.aborts.clear()
                self._inbox.calls.clear()
            self._apply(adds, aborts)
            for call in calls:
                self._deliver_outcome(self._run_call(call))
            self._deliver_outcome(self.core.tick())
            self._flush()  # refusals and handoff results before the step's work
            if self.core.has_work():
                self._step()
                self._flush()

    def _fail(self, error: EngineFailed) -> None:
        """End every request with ``error`` without asking the core, and refuse new ones."""
        with self._wake:
            self.failed = error
            pending = [generation for _, generation in self._inbox.adds]
            self._inbox.adds.clear()
            self._inbox.aborts.clear()
            self._inbox.calls.clear()
        ended = EngineEvent(None, RequestState.FAILED, FinishReason.ERROR, error)
        for generation in [*pending, *self._generations.values()]:
            self._deliver(generation, ended)
        self._generations.clear()
        self._flush()

    def _wait_for_work(self) -> None:
        """Sleep (holding the condition) until there is input, work, a due timer or a stop."""
        while not self._stopping and not self._has_inbox() and not self.core.has_work():
            wakeup = self.core.next_wakeup()
            if wakeup is not None and wakeup <= 0:
                return
            self._wake.wait(wakeup)

    def _run_call(self, call: Callable[[], StepOutcome | None]) -> StepOutcome | None:
        try:
            return call()
        except Exception:  # a bug in one posted call must not stop the engine for everyone
            log.exception("a posted engine call failed")
            return None

    def _has_inbox(self) -> bool:
        return bool(self._inbox.adds or self._inbox.aborts or self._inbox.calls)

    def _apply(self, adds: list[tuple[Request, Generation]], aborts: list[str]) -> None:
        for request, generation in adds:
            try:
                self.core.add(request)
            except KvguardError as error:
                self._deliver(
                    generation, EngineEvent(None, request.state, FinishReason.ERROR, error)
                )
                continue
            self._generations[request.request_id] = generation
        for request_id in aborts:
            aborted = self.core.abort(request_id)
            if aborted is not None:
                self._finish(aborted)

    def _step(self) -> None:
        outcome = self.core.step()
        self._deliver_outcome(outcome)
        if self._on_step is not None:
            self._on_step(outcome)

    def _deliver_outcome(self, outcome: StepOutcome | None) -> None:
        if outcome is None:
            return
        for request in outcome.failed:
            self._finish(request, outcome.proofs.get(request.request_id))
        for result in outcome.results:
            generation = self._generations.get(result.request_id)
            if generation is None:
                continue
            proof = outcome.proofs.get(result.request_id)
            logprobs = outcome.logprobs.get(result.request_id)
            event = EngineEvent(
                result.token, result.state, result.finish_reason, None, proof, logprobs
            )
            self._deliver(generation, event)
            if event.is_terminal:
                del self._generations[result.request_id]

    def _finish(self, request: Request, proof: HandoffProof | None = None) -> None:
        generation = self._generations.pop(request.request_id, None)
        if generation is not None:
            event = EngineEvent(None, request.state, request.finish_reason, request.error, proof)
            self._deliver(generation, event)

    def _deliver(self, generation: Generation, event: EngineEvent) -> None:
        self._outbox.append((generation, event))

    def _flush(self) -> None:
        """Hand the events gathered since the last flush to the event loop: one wake-up."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(_post_all, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            log.debug("dropped %d events for a closed loop", len(batch))

    def _abort_everything(self) -> None:
        with self._wake:
            pending = list(self._inbox.adds)
            self._inbox.adds.clear()
        for request, generation in pending:
            request.transition(RequestState.ABORTED)
            self._deliver(generation, EngineEvent(None, request.state, request.finish_reason))
        for request_id in list(self._generations):
            aborted = self.core.abort(request_id)
            if aborted is not None:
                self._finish(aborted)


def _post_all(batch: list[tuple[Generation, EngineEvent]]) -> None:
    """On the event loop: each request's events of one step, in order."""
    for generation, event in batch:
        generation._post(event)


class EngineFailed(KvguardError):
    """The engine loop failed: this process serves nothing until it is restarted."""

    code = "engine_failed"
    http_status = 503

    def __init__(self, problem: str) -> None:
        self.problem = problem
        message = f"the engine failed ({problem}) and serves nothing until restarted"
        super().__init__(message, problem)


class EngineStopping(KvguardError):
    code = "engine_shutting_down"
    http_status = 503

    def __init__(self) -> None:
        super().__init__("the engine is shutting down")
