"""Both roles in one process over the in-process (and loopback TCP) transport, with the real model.

The transport is where bytes can go wrong without either side's bookkeeping noticing: these tests
wrap it (a fault chosen by construction, as drills are) to corrupt or break a transfer, and check
that decode's checks -- not luck -- stop the request, and that no page stays lost: on the sealed
channel the page's seal refuses a changed byte; on the open channel (development only) the
checksum does. After every handoff nothing of decode's stays registered with the transport.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from backend.config import BackendSettings
from backend.core.request import RequestState, SamplingParams
from backend.disagg.protocol import (
    AbortAck,
    AbortRequest,
    DecodeAnnouncement,
    KvChannel,
    PrefillRequest,
    PrefillResult,
    abort_ack_from_wire,
    abort_request_from_wire,
    decode_announcement_from_wire,
    prefill_request_from_wire,
    prefill_result_from_wire,
    to_wire,
)
from backend.engine.async_engine import EngineEvent
from backend.server.roles import RoleRuntime, build_decode, build_prefill
from backend.transport.base import KvTransport, Segment, TransferError
from backend.transport.inprocess import _REGISTRY, InProcessTransport
from backend.transport.loopback import LoopbackTransport
from contracts.engine import CapacityReport


class LocalChannel:
    """Decode -> prefill without HTTP, but through the wire codec both ways."""

    def __init__(self, runtime: RoleRuntime) -> None:
        assert runtime.prefill is not None
        self.runtime, self.service = runtime, runtime.prefill

    async def prefill(self, message: PrefillRequest, timeout_s: float) -> PrefillResult:
        received = prefill_request_from_wire(to_wire(message))
        return prefill_result_from_wire(to_wire(await self.service.handle(received)))

    async def abort(self, message: AbortRequest, timeout_s: float) -> AbortAck:
        ack = await self.service.abort(abort_request_from_wire(to_wire(message)))
        return abort_ack_from_wire(to_wire(ack))

    async def capacity(self, timeout_s: float) -> CapacityReport:
        return self.runtime.service.capacity()

    async def announce(self, message: DecodeAnnouncement, timeout_s: float) -> None:
        self.announced: DecodeAnnouncement = decode_announcement_from_wire(to_wire(message))


class Corrupting(InProcessTransport):
    """Flips one byte of the first segment of batch ``batch`` after it landed."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.seen = batch, 0

    def write(self, endpoint: str, segments: Sequence[Segment]) -> None:
        super().write(endpoint, segments)
        if self.seen == self.batch:
            byte = ctypes.c_ubyte.from_address(segments[0].dst + 5)
            byte.value ^= 0x40
        self.seen += 1


class Breaking(InProcessTransport):
    """Fails batch ``batch`` (after its bytes partly landed, as a dropped link would)."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.seen = batch, 0

    def write(self, endpoint: str, segments: Sequence[Segment]) -> None:
        if self.seen == self.batch:
            super().write(endpoint, segments[:1])
            raise TransferError("link dropped")
        self.seen += 1
        super().write(endpoint, segments)


@dataclass
class Pair:
    prefill: RoleRuntime
    decode: RoleRuntime
    link: LocalChannel

    async def run(self, n_prompt: int, max_tokens: int = 4) -> list[EngineEvent]:
        prompt = [256] + [97 + i % 26 for i in range(n_prompt - 1)]
        generation = self.decode.service.submit(
            request_id=f"r{n_prompt}",
            tenant="t",
            prompt_ids=prompt,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
        return [event async for event in generation.events()]


@pytest.fixture
async def pair(request: pytest.FixtureRequest, tiny_checkpoint: str) -> AsyncIterator[Pair]:
    """``request.param``: the (wrapped) transport prefill sends with, or a tuple of it, the
    channel and decode's fault drills."""
    transport: KvTransport
    param = request.param if isinstance(request.param, tuple) else (request.param,)
    transport, kv_channel, decode_faults = (*param, *("sealed", ())[len(param) - 1 :])
    common: dict[str, Any] = {
        "model": tiny_checkpoint,
        "pool_tokens": 256,
        "page_size": 16,
        "transport": "inprocess",
        "torch_threads": 1,
        "kv_channel": kv_channel,
    }
    prefill = build_prefill(BackendSettings(**common), transport=transport)
    # Decode receives over the same kind of transport the (wrapped) prefill side sends with.
    kind = "loopback" if isinstance(transport, LoopbackTransport) else "inprocess"
    drills = {"allow_fault_drills": True, "faults": list(decode_faults)} if decode_faults else {}
    settings = BackendSettings(**{**common, "transport": kind, **drills}, transfer_batch_pages=2)
    link = LocalChannel(prefill)
    decode = build_decode(settings, channel=link)
    runtimes = (prefill, decode)
    for runtime in runtimes:
        runtime.service.engine.start()
        await runtime.start()
    yield Pair(prefill, decode, link)
    for runtime in runtimes:
        await runtime.stop()
        await runtime.service.engine.stop()
        for close in runtime.closers:
            close()


async def _all_pages_free(runtime: RoleRuntime) -> bool:
    """Freed pages are zeroed by the engine's next step before they count as free again."""
    pool = runtime.service.pool
    for _ in range(200):
        if pool.free_pages == pool.num_pages:
            return True
        await asyncio.sleep(0.01)
    return False


def _metric(runtime: RoleRuntime, name: str, **labels: str) -> float:
    value = runtime.service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _decode_registered(pair: Pair) -> list[tuple[int, int]]:
    """What decode's in-process transport has registered right now (address, length)."""
    return sorted(_REGISTRY.get(pair.link.announced.target.endpoint, {}).items())


@pytest.mark.parametrize(
    "pair",
    [InProcessTransport(), LoopbackTransport(), (InProcessTransport(), "open")],
    indirect=True,
    ids=["inprocess", "loopback", "inprocess-open"],
)
async def test_each_transport_carries_a_verified_handoff(pair: Pair) -> None:
    events = await pair.run(70)  # 5 pages: three batches of at most 2
    proof = events[0].proof
    assert proof is not None and proof.accepted
    assert proof.transferred_tokens == 70
    sealed = pair.link.announced.target.channel is KvChannel.SEALED
    assert ("seal" in proof.checks) is sealed and ("seal" in proof.skipped_checks) is not sealed
    assert events[-1].state is RequestState.FINISHED
    assert await _all_pages_free(pair.decode)


@pytest.mark.parametrize("pair", [InProcessTransport()], indirect=True)
async def test_a_sealed_handoff_leaves_nothing_registered(pair: Pair) -> None:
    assert _decode_registered(pair) == []  # at rest: not the pool, not a standing buffer
    (*_, last) = await pair.run(40)
    assert last.state is RequestState.FINISHED
    assert _decode_registered(pair) == []  # the handoff's slots were withdrawn at its end


@pytest.mark.parametrize(
    ("pair", "check"),
    [(Corrupting(batch=1), "seal"), ((Corrupting(batch=1), "open"), "checksum")],
    indirect=["pair"],
    ids=["sealed", "open"],
)
async def test_a_corrupted_transfer_is_refused(pair: Pair, check: str) -> None:
    events = await pair.run(70)
    (event,) = events
    assert event.state is RequestState.FAILED
    assert event.error is not None and event.error.code == "kv_handoff_refused"
    assert event.proof is not None and event.proof.failed_check == check
    refusals = "kvguard_engine_handoff_refusals_total"
    assert _metric(pair.decode, refusals, check=check) == 1
    checksum_failures = _metric(pair.decode, "kvguard_engine_handoff_checksum_failures_total")
    assert checksum_failures == (1 if check == "checksum" else 0)
    # Prefill's result means no write is in flight: the pages are free again at once.
    assert await _all_pages_free(pair.decode)


@pytest.mark.parametrize("pair", [Breaking(batch=1)], indirect=True)
async def test_a_broken_transfer_fails_the_request_and_frees_both_sides(pair: Pair) -> None:
    (event,) = await pair.run(70)
    assert event.state is RequestState.FAILED
    assert event.error is not None and event.error.code == "kv_handoff_failed"
    assert event.proof is not None and event.proof.outcome == "failed"
    assert await _all_pages_free(pair.decode)
    assert _metric(pair.prefill, "kvguard_engine_handoffs_total", outcome="failed") == 1
    assert pair.prefill.prefill is not None
    assert _metric(pair.prefill, "kvguard_engine_staging_pages", state="free") == 256 // 16


@pytest.mark.parametrize(
    ("pair", "outcome"),
    [
        ((Corrupting(batch=1), "sealed", ("skip_checksum",)), "refused by the seal"),
        ((Corrupting(batch=1), "sealed", ("skip_seal_check", "skip_checksum")), "accepted"),
    ],
    indirect=["pair"],
    ids=["seal-alone", "no-seal-no-checksum"],
)
async def test_the_seal_alone_refuses_a_changed_byte_and_its_drill_lets_it_through(
    pair: Pair, outcome: str
) -> None:
    """The seal is a defence of its own (the checksum drilled away, it still refuses), and the
    skip_seal_check drill removes exactly it: the changed byte reaches the pages."""
    events = await pair.run(70)
    proof = events[0].proof
    assert proof is not None and "checksum" in proof.skipped_checks
    if outcome == "accepted":
        assert proof.accepted and "seal" in proof.skipped_checks
        assert events[-1].state is RequestState.FINISHED
    else:
        assert not proof.accepted and proof.failed_check == "seal"
        assert events[0].error is not None and events[0].error.code == "kv_handoff_refused"
