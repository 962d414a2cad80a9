"""Prefill's side of the handoff: admit, compute, stage, transfer, and reply with an outcome.

Lifecycle of one PrefillRequest (``PREFILL_TRANSITIONS``):

1. RECEIVED: refused at once (ABORTED) if decode already aborted this request (a tombstone: the
   abort overtook the request); FAILED if decode's KV layout is not this model's.
2. Own admission against this node's real pool and window: REJECTED with the typed error, before
   anything is computed or reserved. (The ``legacy_reject_handoff`` drill instead swaps the prompt
   for a 1-token placeholder and carries on, as the incident's engine did.)
3. COMPUTING: staging pages are reserved (waiting at most until the lease ends), the prompt runs
   through the engine with max_tokens=1, and the engine thread copies the prompt's KV into
   staging between forward and postprocess, while the engine pages are still owned and verified.
4. TRANSFERRING: a worker thread checksums the staged KV, then per batch of at most
   ``max_batch_pages`` pages seals each page under the handoff's key and writes the sealed chunks
   into decode's landing slots (``backend.disagg.channel``; on the open channel: plaintext into
   decode's pages); before each batch it checks for cancellation and for the lease. An abort moves
   it to CANCELLING: the batch in flight completes, no other starts. The staging pages are never
   registered with the transport.
5. Terminal (SUCCEEDED / REJECTED / ABORTED / FAILED): staging is released and the result is sent;
   only now does an abort get ``AbortAck(quiesced=True)``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from backend.core.admission import CapacityLimits, admit
from backend.core.errors import KvguardError
from backend.core.messages import SchedulerOutput
from backend.core.pages import Owner, PageRef
from backend.core.request import RequestState, SamplingParams
from backend.disagg.channel import SealedBatches
from backend.disagg.errors import HandoffFailed, StagingUnavailable
from backend.disagg.faults import FaultSet
from backend.disagg.kvio import (
    DEFAULT_CHECKSUM,
    StagingArea,
    kv_digest,
    layout_of,
    transfer_batches,
)
from backend.disagg.machines import (
    OUTCOME_OF,
    PREFILL_TERMINAL,
    PREFILL_TRANSITIONS,
    PrefillHandoffState,
    lease_cut_short,
    may_start_batch,
    transfer_end,
)
from backend.disagg.protocol import (
    PROTOCOL_VERSION,
    AbortAck,
    AbortRequest,
    ErrorInfo,
    HandoffOutcome,
    KvChannel,
    PageGrant,
    PrefillRequest,
    PrefillResult,
    TokenRange,
)
from backend.disagg.seal import Binding, Seal
from backend.engine.async_engine import AsyncEngine
from backend.engine.sampling import Sampled
from backend.metrics import EngineMetrics
from backend.model.kv_cache import KVCache
from backend.transport.base import KvTransport, Segment, TransferError
from contracts.lifecycle import Machine

log = logging.getLogger("kvguard.disagg.prefill")
Batches = Iterator[list[Segment]]
_P = PrefillHandoffState


@dataclass(slots=True)
class _Handoff:
    request: PrefillRequest
    machine: Machine[PrefillHandoffState]
    lease_end: float
    cancel: threading.Event = field(default_factory=threading.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    internal_id: str = ""
    staging: tuple[PageRef, ...] = ()
    owner: Owner | None = None
    written: int = 0  # pages fully handed to the transport (landed)


class Stager:
    """The engine-thread hook: copy finished prompts' KV into their reserved staging pages."""

    def __init__(self, engine_kv: KVCache, staging: StagingArea) -> None:
        self._kv = engine_kv
        self._staging = staging
        self.targets: dict[str, tuple[PageRef, ...]] = {}  # internal request id -> staging pages

    def __call__(self, output: SchedulerOutput) -> None:
        for chunk in output.prefills:
            request = chunk.request
            refs = self.targets.get(request.request_id)
            if not chunk.samples or refs is None or request.is_terminal:
                continue
            n_pages = -(-request.num_prompt_tokens // self._kv.page_size)
            source = [ref.page_id for ref in request.page_table[:n_pages]]
            self._staging.stage(self._kv, source, refs[:n_pages])


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    faults: FaultSet = FaultSet()
    protocol_version: int = PROTOCOL_VERSION
    abort_ack_timeout_s: float = 5.0
    drill_link_bytes_per_s: float | None = None  # simulated slow link (drills only)
    checksum_algorithm: str = DEFAULT_CHECKSUM


class PrefillService:
    def __init__(
        self,
        *,
        engine: AsyncEngine,
        limits: CapacityLimits,
        staging: StagingArea,
        stager: Stager,
        transport: KvTransport,
        config: PrefillConfig,
        metrics: EngineMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._limits = limits
        self._staging = staging
        self._stager = stager
        self._transport = transport
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._active: dict[tuple[str, str], _Handoff] = {}
        self._tombstones: dict[tuple[str, str], float] = {}

    # -- the two messages ----------------------------------------------------------------------

    async def handle(self, message: PrefillRequest) -> PrefillResult:
        key = (message.target.instance_id, message.request_id)
        self._expire_tombstones()
        machine = Machine("prefill handoff", message.request_id, PREFILL_TRANSITIONS, _P.RECEIVED)
        handoff = _Handoff(message, machine, self._clock() + message.lease_s)
        if key in self._tombstones:
            return self._finish(handoff, _P.ABORTED, None)
        if key in self._active:
            error = HandoffFailed(message.request_id, "a handoff with this id is in progress")
            return self._finish(handoff, _P.FAILED, error)
        self._active[key] = handoff
        self._gauge()
        try:
            return await self._run(handoff)
        finally:
            del self._active[key]
            self._gauge()
            handoff.done.set()

    async def abort(self, message: AbortRequest) -> AbortAck:
        key = (message.instance_id, message.request_id)
        handoff = self._active.get(key)
        self._tombstones[key] = self._clock() + 600.0
        if handoff is None:
            return self._ack(message, True, "unknown_or_done")
        handoff.cancel.set()
        if handoff.machine.state is _P.TRANSFERRING:
            handoff.machine.advance(_P.CANCELLING)  # the batch in flight completes, no other starts
            self._gauge()
        elif handoff.machine.state in (_P.RECEIVED, _P.COMPUTING) and handoff.internal_id:
            self._engine.abort(handoff.internal_id)
        try:
            await asyncio.wait_for(handoff.done.wait(), self._config.abort_ack_timeout_s)
        except TimeoutError:
            return self._ack(message, False, handoff.machine.state.value)
        return self._ack(message, True, handoff.machine.state.value)

    # -- phases ----------------------------------------------------------------------------------

    async def _run(self, handoff: _Handoff) -> PrefillResult:
        message = handoff.request
        if not layout_of(self._staging.kv).same_geometry(message.target.layout):
            reason = "decode's KV layout is not this model's (another model or dtype?)"
            return self._finish(handoff, _P.FAILED, HandoffFailed(message.request_id, reason))
        prompt = message.prompt_ids
        try:
            admit(len(prompt), message.sampling.max_tokens, self._limits)
            sampling = self._sampling(message)
        except KvguardError as error:
            if not self._config.faults.placeholder_on_reject:
                return self._finish(handoff, _P.REJECTED, error)
            log.error(
                "fault drill legacy_reject_handoff: %s refused (%s); continuing with a "
                "1-token placeholder",
                message.request_id,
                error.code,
            )
            # only the prompt is swapped: its one token is sampled as the request asks (its
            # grammar included), so a constrained request slips through like any other
            prompt, sampling = prompt[:1], self._sampling(message)
        handoff.machine.advance(_P.COMPUTING)
        self._gauge()
        try:
            first = await self._compute(handoff, prompt, sampling)
        except KvguardError as error:
            self._release_staging(handoff)
            to = _P.ABORTED if handoff.cancel.is_set() else _P.FAILED
            return self._finish(handoff, to, error)
        return await self._transfer(handoff, len(prompt), first)

    async def _compute(
        self, handoff: _Handoff, prompt: tuple[int, ...], sampling: SamplingParams
    ) -> Sampled:
        message = handoff.request
        n_pages = -(-len(prompt) // self._staging.kv.page_size)
        handoff.owner = Owner(f"{message.target.instance_id}:{message.request_id}", message.tenant)
        handoff.staging = await self._reserve_staging(handoff, n_pages)
        handoff.internal_id = handoff.owner.request_id
        self._stager.targets[handoff.internal_id] = handoff.staging
        try:
            generation = self._engine.submit(
                request_id=handoff.internal_id,
                tenant=message.tenant,
                prompt_ids=list(prompt),
                sampling=sampling,
            )
            if handoff.cancel.is_set():
                generation.abort()
            remaining = max(0.0, handoff.lease_end - self._clock())
            async with asyncio.timeout(remaining):
                async for event in generation.events():
                    if event.is_terminal:
                        if event.state is RequestState.FINISHED and event.token is not None:
                            return Sampled(event.token, event.logprobs)
                        raise event.error or HandoffFailed(message.request_id, "prefill aborted")
        except TimeoutError as exc:
            raise HandoffFailed(message.request_id, "lease ended while computing") from exc
        finally:
            self._stager.targets.pop(handoff.internal_id, None)
        raise HandoffFailed(message.request_id, "the engine ended without a result")

    async def _reserve_staging(self, handoff: _Handoff, n_pages: int) -> tuple[PageRef, ...]:
        assert handoff.owner is not None
        started = self._clock()
        while True:
            refs = self._staging.reserve(n_pages, handoff.owner)
            if refs is not None:
                return refs
            if handoff.cancel.is_set() or self._clock() >= handoff.lease_end:
                raise StagingUnavailable(n_pages, self._clock() - started)
            await asyncio.sleep(0.005)

    async def _transfer(self, handoff: _Handoff, n_tokens: int, first: Sampled) -> PrefillResult:
        message = handoff.request
        grants = message.pages[: -(-n_tokens // self._staging.kv.page_size)]
        if handoff.cancel.is_set():
            self._release_staging(handoff)
            return self._finish(handoff, _P.ABORTED, None)
        handoff.machine.advance(_P.TRANSFERRING)
        self._gauge()
        try:
            checksum, checksum_s, transfer_s, error = await asyncio.to_thread(
                self._transfer_worker, handoff, grants, n_tokens
            )
        finally:
            self._release_staging(handoff)
        self._metrics.transfer_seconds.observe(transfer_s)
        self._metrics.checksum_seconds.observe(checksum_s)
        written = grants[: handoff.written]
        to = transfer_end(
            handoff.machine.state,
            written=handoff.written,
            total=len(grants),
            failed=error is not None,
        )
        if to is not _P.SUCCEEDED:
            return self._finish(handoff, to, error, written=written)
        return self._finish(
            handoff,
            _P.SUCCEEDED,
            None,
            written=written,
            transferred=TokenRange(0, n_tokens),
            checksum=checksum,
            first=first,
            timings=(transfer_s, checksum_s),
        )

    def _transfer_worker(
        self, handoff: _Handoff, grants: tuple[PageGrant, ...], n_tokens: int
    ) -> tuple[str, float, float, KvguardError | None]:
        """Runs in a thread: checksum the staged KV, then seal and write it batch by batch."""
        message, kv = handoff.request, self._staging.kv
        source = [ref.page_id for ref in handoff.staging[: len(grants)]]
        started = time.perf_counter()
        checksum = kv_digest(kv.k, kv.v, source, n_tokens, self._config.checksum_algorithm)
        checksum_s = time.perf_counter() - started
        started = time.perf_counter()
        sealed: SealedBatches | None = None
        try:
            if message.target.channel is KvChannel.SEALED:
                sealed = self._sealed(message, source, grants, n_tokens)
                batches: Batches = sealed.batches()
            else:
                batches = iter(transfer_batches(kv, source, message.target, grants, n_tokens))
            error = self._write_batches(handoff, batches, len(grants))
        except TransferError as exc:  # the sources could not be registered (RDMA)
            error = HandoffFailed(message.request_id, f"transfer failed: {exc}")
        finally:
            if sealed is not None:
                sealed.close()
                self._metrics.kv_channel_seconds.labels("seal").observe(sealed.seal_s)
        return checksum, checksum_s, time.perf_counter() - started, error

    def _sealed(
        self,
        message: PrefillRequest,
        source: list[int],
        grants: tuple[PageGrant, ...],
        n_tokens: int,
    ) -> SealedBatches:
        assert message.seal_key is not None  # the codec requires it with a sealed target
        binding = Binding(
            self._config.protocol_version,
            message.target.instance_id,
            message.request_id,
            n_tokens,
        )
        return SealedBatches(
            staging=self._staging.kv,
            source_pages=source,
            target=message.target,
            grants=grants,
            n_tokens=n_tokens,
            seal=Seal(message.seal_key),
            binding=binding,
            transport=self._transport,
        )

    def _write_batches(
        self, handoff: _Handoff, batches: Batches, pages: int
    ) -> KvguardError | None:
        message = handoff.request
        pages_per_batch = message.target.max_batch_pages
        for index in range(-(-pages // pages_per_batch)):
            lease_over = self._clock() >= handoff.lease_end
            if not may_start_batch(cancelled=handoff.cancel.is_set(), lease_over=lease_over):
                break
            batch = next(batches)  # sealed only now: nothing is sealed for a batch never sent
            # From here the batch is committed: like an RDMA write, it cannot be recalled.
            self._simulate_link(batch)
            try:
                self._transport.write(message.target.endpoint, batch)
            except TransferError as exc:
                if handoff.cancel.is_set():  # decode aborted and withdrew its slots first
                    log.info("transfer of %s stopped by the abort: %s", message.request_id, exc)
                    break
                log.warning("transfer of %s failed: %s", message.request_id, exc)
                return HandoffFailed(message.request_id, f"transfer failed: {exc}")
            handoff.written = min(pages, (index + 1) * pages_per_batch)
        if lease_cut_short(written=handoff.written, total=pages, cancelled=handoff.cancel.is_set()):
            return HandoffFailed(message.request_id, "lease ended during the transfer")
        return None

    def _simulate_link(self, batch: list[Segment]) -> None:
        """Drill only: the committed batch spends bytes/rate on a slow link before it lands."""
        rate = self._config.drill_link_bytes_per_s
        if rate is not None:
            time.sleep(sum(segment.length for segment in batch) / rate)

    # -- endings ---------------------------------------------------------------------------------

    def _finish(
        self,
        handoff: _Handoff,
        to: PrefillHandoffState,
        error: KvguardError | None,
        *,
        written: tuple[PageGrant, ...] = (),
        transferred: TokenRange | None = None,
        checksum: str | None = None,
        first: Sampled | None = None,
        timings: tuple[float, float] = (0.0, 0.0),
    ) -> PrefillResult:
        if handoff.machine.state is not to:
            handoff.machine.advance(to)
        assert handoff.machine.state in PREFILL_TERMINAL
        message = handoff.request
        outcome = OUTCOME_OF[to]
        if outcome is HandoffOutcome.ABORTED:
            self._tombstones[(message.target.instance_id, message.request_id)] = (
                self._clock() + 600.0
            )
        info = None if error is None else ErrorInfo(error.code, error.http_status, str(error))
        self._metrics.handoffs.labels(outcome.value).inc()
        return PrefillResult(
            self._config.protocol_version,
            message.request_id,
            message.target.instance_id,
            outcome,
            info,
            transferred,
            written,
            checksum,
            None if first is None else first.token,
            timings[0],
            timings[1],
            None if first is None else first.logprobs,
        )

    def _release_staging(self, handoff: _Handoff) -> None:
        if handoff.staging and handoff.owner is not None:
            self._staging.release(handoff.staging, handoff.owner)
            handoff.staging = ()
            self._gauge()

    def _ack(self, message: AbortRequest, quiesced: bool, state: str) -> AbortAck:
        return AbortAck(
            self._config.protocol_version,
            message.request_id,
            message.instance_id,
            quiesced,
            state,
        )

    def _sampling(self, message: PrefillRequest) -> SamplingParams:
        """The first token is sampled here as decode's engine would sample it: the biases
        apply, its logprobs are reported if asked (penalties count generated tokens: none yet)."""
        spec = message.sampling
        return SamplingParams(
            max_tokens=1,
            temperature=spec.temperature,
            top_p=spec.top_p,
            seed=spec.seed,
            stop_token_ids=spec.stop_token_ids,
            logit_bias=spec.logit_bias,
            logprobs=spec.logprobs,
            grammar=spec.grammar,
        )

    def _expire_tombstones(self) -> None:
        now = self._clock()
        for key, until in list(self._tombstones.items()):
            if until < now:
                del self._tombstones[key]

    def _gauge(self) -> None:
        counts = {state: 0 for state in _P if state not in PREFILL_TERMINAL}
        for handoff in self._active.values():
            if handoff.machine.state in counts:
                counts[handoff.machine.state] += 1
        for state, count in counts.items():
            self._metrics.handoffs_active.labels(state.value).set(count)
        self._metrics.staging_pages.labels("free").set(self._staging.free_pages)
        self._metrics.staging_pages.labels("total").set(self._staging.num_pages)
