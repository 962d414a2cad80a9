"""Decode's engine-thread side of the handoff: reserve, hand out tickets, verify, accept or drain.

Lifecycle of one request here (the handoff's states are ``DECODE_TRANSITIONS``):

1. ``add``: admission (raises, REJECTED, nothing reserved) -> waiting for pages.
2. Pages reserved (AWAITING_KV): on the sealed channel their landing slots are registered with
   the transport for this handoff alone and a fresh seal key is drawn; a ``SendHandoff`` notice
   carries the ticket (with the key) to the event loop, which sends the PrefillRequest. From this
   moment prefill may write into the slots (on the open channel: into the pages themselves).
3. ``complete(result)``: the slots are withdrawn; VERIFYING -> ACCEPTED (the request joins the
   decode batch with prefill's first token) only on positive evidence (``verify_result``: the
   seals are opened from a private copy of the slots, ``backend.disagg.channel``), and only then
   is the KV moved into the pages; otherwise the request ends with the original error and its
   pages are freed (a result is sent only once prefill is quiescent). A seal that does not open
   fails that request alone (``kv_handoff_refused``, check ``seal``): nothing a peer of the
   transfer port writes quarantines anything.
4. ``abort`` / ``lost`` (client gone, timeout, prefill unreachable, unreadable reply) while
   AWAITING_RESULT: the slots are withdrawn, the request ends at once, its pages go to quarantine
   (DRAINING, which keeps their slots from reuse too) and a ``SendAbort`` notice asks prefill to
   stop. ``drained`` (prefill acknowledged quiescence, or its
   late result arrived) or the drain deadline (``tick``) releases them with bumped generations.
   Prefill's result (before or after an ack) names the pages it wrote: writes the quarantine
   absorbed are counted, and in the early-release drill, writes that landed after the release.
5. ``step``: the base engine step for DECODING requests, then any newly possible reservation.

With fault drills, the table and checks come from the ``FaultSet``; a drill read log (only when
drills are allowed) records page fingerprints at acceptance and at the end of each request.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.core.errors import KvguardError
from backend.core.request import Request, RequestState
from backend.disagg.channel import Landing, LandingSlots
from backend.disagg.decode_checks import HandoffFacts, ResultChecks
from backend.disagg.decode_scheduler import DecodeScheduler, Release
from backend.disagg.errors import (
    HandoffFailed,
    HandoffTimedOut,
    ProtocolVersionMismatch,
)
from backend.disagg.faults import FaultSet
from backend.disagg.machines import (
    DecodeHandoffState,
    Expectation,
    refusal,
    release_deadline,
)
from backend.disagg.protocol import (
    PROTOCOL_VERSION,
    HandoffOutcome,
    PageGrant,
    PrefillResult,
    SamplingSpec,
)
from backend.disagg.read_log import ReadLog
from backend.disagg.seal import Seal, new_key
from backend.engine.core import EngineCore, StepOutcome
from backend.engine.runner import ModelRunner
from backend.metrics import EngineMetrics
from backend.transport.base import TransferError
from contracts.engine import HandoffProof
from contracts.lifecycle import Machine

log = logging.getLogger("kvguard.disagg.decode")
_S = DecodeHandoffState


@dataclass(frozen=True, slots=True)
class HandoffTicket:
    """Everything the event loop needs to send one PrefillRequest.

    ``handoff_id`` names this handoff on the wire: the request id plus a per-instance sequence
    number, so a client that reuses a request id never meets the old handoff's leftovers.
    ``seal_key`` (sealed channel) is the handoff's own key: it leaves only in the PrefillRequest.
    """

    request_id: str
    handoff_id: str
    tenant: str
    prompt_ids: tuple[int, ...] = field(repr=False)
    sampling: SamplingSpec
    grants: tuple[PageGrant, ...]
    seal_key: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class SendHandoff:
    ticket: HandoffTicket


@dataclass(frozen=True, slots=True)
class SendAbort:
    request_id: str
    handoff_id: str


Notice = SendHandoff | SendAbort


@dataclass(frozen=True, slots=True)
class DecodeHandoffConfig:
    instance_id: str
    lease_s: float  # prefill starts no batch after this; decode waits this long for a result
    drain_s: float  # the justified drain bound (machines.drain_bound_s)
    faults: FaultSet = FaultSet()
    result_grace_s: float = 1.0  # backstop beyond the loop-side timeout
    protocol_version: int = PROTOCOL_VERSION
    keep_read_log: bool = False


@dataclass(slots=True)
class _Handoff:
    request_id: str  # the client's id; expect.request_id is the handoff id on the wire
    machine: Machine[DecodeHandoffState]
    expect: Expectation
    sent_at: float
    landing: Landing | None = None  # the sealed channel's registered slots, until withdrawn
    seal: Seal | None = field(default=None, repr=False)  # dropped with the handoff
    drain_started: float | None = None
    drain_deadline: float | None = None

    def withdraw(self) -> None:
        if self.landing is not None:
            self.landing.withdraw()


class DecodeEngineCore(EngineCore):
    def __init__(
        self,
        scheduler: DecodeScheduler,
        runner: ModelRunner,
        config: DecodeHandoffConfig,
        *,
        notify: Callable[[Notice], None],
        landing: LandingSlots | None = None,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(scheduler, runner)
        self.decode = scheduler
        self.config = config
        self.landing = landing  # None: the open channel (prefill writes into the pages)
        self._notify = notify
        self._metrics = metrics
        self._clock = clock
        self._handoffs: dict[str, _Handoff] = {}
        # Handoffs whose pages left this core before prefill's result came, by request id: how
        # they left ("ack" after a drain, or "early" in the drill), the handoff id, and when.
        self._released: dict[str, tuple[str, str, float]] = {}
        self._sequence = itertools.count(1)
        self.read_log = ReadLog(runner.kv_cache) if config.keep_read_log else None
        self.checks = ResultChecks(
            pool=scheduler.pool,
            kv=runner.kv_cache,
            faults=config.faults,
            protocol_version=config.protocol_version,
            instance_id=config.instance_id,
            metrics=metrics,
        )
        self._unsent: list[Request] = []  # failed before their ticket left (delivered by tick)

    # -- requests in ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.decode.add(request)
        self._reserve()

    def abort(self, request_id: str) -> Request | None:
        waiting = self.decode.abort_waiting(request_id)
        if waiting is not None:
            return waiting
        handoff = self._handoffs.get(request_id)
        if handoff is None or handoff.machine.state is not _S.AWAITING_RESULT:
            return super().abort(request_id)
        handoff.withdraw()
        if self.config.faults.early_release:
            # The drill: pages go back to the free list while prefill may still be writing.
            handoff.machine.advance(_S.RELEASED)
            request = self.decode.end_awaiting(
                request_id, RequestState.ABORTED, release=Release.FREE
            )
            del self._handoffs[request_id]
            self._released[request_id] = ("early", handoff.expect.request_id, self._clock())
            log.error(
                "fault drill early_release_on_abort: freed %d pages of %s with writes "
                "possibly in flight",
                len(handoff.expect.grants),
                request_id,
            )
        else:
            handoff.machine.advance(_S.DRAINING)
            request = self.decode.end_awaiting(
                request_id, RequestState.ABORTED, release=Release.DRAIN
            )
            self._start_drain(handoff)
        self._count("aborted")
        self._notify(SendAbort(request_id, handoff.expect.request_id))
        return request

    # -- handoff results in --------------------------------------------------------------------

    def complete(self, request_id: str, result: PrefillResult) -> StepOutcome | None:
        """Prefill's result for ``request_id`` arrived (so prefill is quiescent for it)."""
        handoff = self._handoffs.get(request_id)
        if handoff is None:
            self._late_result(request_id, result)
            return None
        if handoff.machine.state is _S.DRAINING:
            self._absorbed(request_id, result)
            self._release(request_id, handoff, "result")
            return None
        if handoff.machine.state is not _S.AWAITING_RESULT:
            return None
        handoff.withdraw()  # prefill is quiescent: nothing more may land, whatever comes next
        handoff.machine.advance(_S.VERIFYING)
        if self._metrics is not None:
            self._metrics.handoff_seconds.observe(self._clock() - handoff.sent_at)
        facts = self._facts(handoff)
        verdict, opened = self.checks.check(facts, result)
        outcome = StepOutcome(proofs={request_id: self.checks.proof(facts, result, verdict)})
        if verdict.accepted:
            assert result.first_token is not None  # an OK result always carries it
            if opened is not None:
                self.checks.move(facts, opened)
            try:
                step = self.decode.accept(request_id, result.first_token)
            except KvguardError as refused:
                outcome.failed.append(self._not_accepted(request_id, handoff, refused))
                self._reserve()
                return outcome
            handoff.machine.advance(_S.ACCEPTED)
            del self._handoffs[request_id]
            outcome.results.append(step)
            if handoff.expect.logprobs and result.first_token_logprobs is not None:
                outcome.logprobs[request_id] = result.first_token_logprobs
            if self.read_log is not None:
                self.read_log.accepted(request_id, handoff.expect)
            self._count(HandoffOutcome.OK.value)
        else:
            to, error = refusal(request_id, result, verdict)
            outcome.failed.append(
                self.decode.end_awaiting(request_id, to, error, release=Release.FREE)
            )
            handoff.machine.advance(_S.RELEASED)
            del self._handoffs[request_id]
            self._count(result.outcome.value)
        self._reserve()
        return outcome

    def _not_accepted(self, request_id: str, handoff: _Handoff, error: KvguardError) -> Request:
        """The scheduler refused a verified request's entry (a bug, never a client's): prefill is
        quiescent, so the request fails with that error and its pages are freed, not left held."""
        log.error("handoff %s verified but not accepted: %s", request_id, error.code)
        handoff.machine.advance(_S.RELEASED)
        del self._handoffs[request_id]
        self._count(HandoffOutcome.FAILED.value)
        return self.decode.end_awaiting(
            request_id, RequestState.FAILED, error, release=Release.FREE
        )

    def lost(self, request_id: str, error: KvguardError) -> StepOutcome | None:
        """No readable result will come (timeout, peer lost, unreadable reply): fail and drain."""
        handoff = self._handoffs.get(request_id)
        if handoff is None or handoff.machine.state is not _S.AWAITING_RESULT:
            return None
        handoff.withdraw()
        handoff.machine.advance(_S.DRAINING)
        request = self.decode.end_awaiting(
            request_id, RequestState.FAILED, error, release=Release.DRAIN
        )
        self._start_drain(handoff)
        kind = _lost_kind(error)
        self._count(kind)
        log.warning("handoff %s lost (%s): %s; pages drain", request_id, kind, error.code)
        proof = HandoffProof(
            self.config.protocol_version,
            kind,
            handoff.expect.reserved_tokens,
            None,
            False,
            (),
            (),
            None,
        )
        return StepOutcome(failed=[request], proofs={request_id: proof})

    def drained(self, request_id: str, reason: str) -> StepOutcome | None:
        """Prefill confirmed that no write for ``request_id`` is or will be in flight."""
        handoff = self._handoffs.get(request_id)
        if handoff is not None and handoff.machine.state is _S.DRAINING:
            self._release(request_id, handoff, reason)
        return None

    # -- time ------------------------------------------------------------------------------------

    def tick(self) -> StepOutcome:
        now = self._clock()
        outcome = StepOutcome(failed=self._unsent)
        self._unsent = []
        for request_id, handoff in list(self._handoffs.items()):
            state = handoff.machine.state
            if state is _S.DRAINING and handoff.drain_deadline is not None:
                if handoff.drain_deadline <= now:
                    self._release(request_id, handoff, "timeout")
            elif state is _S.AWAITING_RESULT and now >= self._result_deadline(handoff):
                lost = self.lost(request_id, HandoffTimedOut(request_id, self.config.lease_s))
                if lost is not None:
                    outcome.merge(lost)
        horizon = self.config.lease_s + self.config.drain_s
        for request_id, (_, _, at) in list(self._released.items()):
            if now - at > horizon:
                del self._released[request_id]
        self._reserve()
        return outcome

    def next_wakeup(self) -> float | None:
        deadlines = [
            h.drain_deadline if h.machine.state is _S.DRAINING else self._result_deadline(h)
            for h in self._handoffs.values()
            if h.machine.state in (_S.DRAINING, _S.AWAITING_RESULT)
        ]
        valid = [d for d in deadlines if d is not None]
        return None if not valid else max(0.0, min(valid) - self._clock())

    def step(self) -> StepOutcome:
        outcome = super().step()
        if self.read_log is not None:
            for result in outcome.results:
                if result.state in (RequestState.FINISHED,):
                    self.read_log.finished(result.request_id)
        self._reserve()
        return outcome

    # -- internals -----------------------------------------------------------------------------

    def _reserve(self) -> None:
        pool = self.decode.pool
        for request in self.decode.reserve_ready():
            prompt_pages = pool.pages_for(request.num_prompt_tokens)
            grants = tuple(
                PageGrant(ref.page_id, ref.generation) for ref in request.page_table[:prompt_pages]
            )
            rid = request.request_id
            handoff_id = f"{rid}.{next(self._sequence)}"
            s = request.sampling
            expect = Expectation(
                handoff_id,
                self.config.instance_id,
                request.num_prompt_tokens,
                grants,
                logprobs=s.logprobs is not None,
            )
            machine = Machine("handoff", rid, self.config.faults.decode_table, _S.RESERVED)
            handoff = _Handoff(rid, machine, expect, self._clock())
            key = self._open_landing(handoff)
            if handoff.machine.state is _S.RELEASED:
                continue
            # The ticket leaves now: from here on prefill may write into the slots (or pages).
            machine.advance(_S.AWAITING_RESULT)
            self._handoffs[rid] = handoff
            sampling = SamplingSpec(
                s.max_tokens,
                s.temperature,
                s.top_p,
                s.seed,
                s.stop_token_ids,
                s.logit_bias,
                s.logprobs,
                s.grammar,
            )
            ticket = HandoffTicket(
                rid, handoff_id, request.tenant, request.prompt_ids, sampling, grants, key
            )
            self._notify(SendHandoff(ticket))

    def _open_landing(self, handoff: _Handoff) -> bytes | None:
        """Sealed channel: register the handoff's slots and draw its key. A transport that
        refuses the registration fails the request before anything was sent (pages freed)."""
        if self.landing is None:
            return None
        started = time.perf_counter()
        try:
            handoff.landing = self.landing.open(handoff.expect.grants)
        except TransferError as exc:
            log.error("handoff %s: landing slots not registered: %s", handoff.request_id, exc)
            error = HandoffFailed(handoff.request_id, "its KV landing slots were not registered")
            self._unsent.append(
                self.decode.end_awaiting(
                    handoff.request_id, RequestState.FAILED, error, release=Release.FREE
                )
            )
            handoff.machine.advance(_S.RELEASED)
            self._count(HandoffOutcome.FAILED.value)
            return None
        self.checks.phase("register", started)
        key = new_key()
        handoff.seal = Seal(key)
        return key

    def _facts(self, handoff: _Handoff) -> HandoffFacts:
        request = self.decode.awaiting(handoff.request_id)
        owner = None if request is None else request.owner
        return HandoffFacts(
            handoff.request_id, handoff.expect, owner, handoff.landing, handoff.seal
        )

    def _start_drain(self, handoff: _Handoff) -> None:
        now = self._clock()
        handoff.drain_started = now
        handoff.drain_deadline = release_deadline(
            now, handoff.sent_at, self.config.lease_s, self.config.drain_s
        )

    def _release(self, request_id: str, handoff: _Handoff, reason: str) -> None:
        pages = self.decode.release_drain(request_id)
        handoff.machine.advance(_S.RELEASED)
        del self._handoffs[request_id]
        if reason == "ack":  # prefill's result may still be on its way: it tells what was written
            self._released[request_id] = ("ack", handoff.expect.request_id, self._clock())
        waited = self._clock() - (handoff.drain_started or self._clock())
        log.info(
            "drain of %s ended (%s) after %.3f s: %d pages freed", request_id, reason, waited, pages
        )
        if self._metrics is not None:
            self._metrics.drain_seconds.labels(reason).observe(waited)
            self._metrics.drained_pages.labels(reason).inc(pages)
        self._reserve()

    def _late_result(self, request_id: str, result: PrefillResult) -> None:
        released = self._released.pop(request_id, None)
        if released is None or released[1] != result.request_id:
            return  # not a handoff this core released recently
        if released[0] == "ack":  # acknowledged quiescence: every write landed before the release
            self._absorbed(request_id, result)
        elif result.pages_written:
            pages = len(result.pages_written)
            drill = "early_release_on_abort drill"
            log.error("handoff %s: %d pages written after release (%s)", request_id, pages, drill)
            if self._metrics is not None:
                self._metrics.handoff_late_writes.inc(pages)

    def _absorbed(self, request_id: str, result: PrefillResult) -> None:
        """Prefill wrote these pages while they sat in quarantine: the drain kept them unread."""
        pages = len(result.pages_written)
        if pages:
            log.info("handoff %s: %d pages written during the quarantine", request_id, pages)
            if self._metrics is not None:
                self._metrics.quarantine_absorbed_writes.inc(pages)

    def _result_deadline(self, handoff: _Handoff) -> float:
        return handoff.sent_at + self.config.lease_s + self.config.result_grace_s

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.handoffs.labels(outcome).inc()


def _lost_kind(error: KvguardError) -> str:
    if isinstance(error, HandoffTimedOut):
        return "timeout"
    if isinstance(error, ProtocolVersionMismatch):
        return "protocol_mismatch"
    return "lost"
