"""Prefill's moves and the transport in the model, mirroring ``PrefillService`` step by step.

``receive`` is ``handle`` up to COMPUTING (wire codec with prefill's version, tombstones, its own
``admit``, the legacy placeholder); ``commit_batch`` / ``transfer_done`` are the transfer worker's
loop (``may_start_batch``, ``lease_cut_short``, ``transfer_end``); ``abort`` is ``abort``;
``finish`` is ``_finish``. A committed batch's writes sit in ``World.writes`` until the transport
lands them, in any order and interleaved with every control message: into decode's landing slots
(sealed, whatever became of them meanwhile), or on the open channel into its pages.
"""

from __future__ import annotations

from dataclasses import replace

from backend.core.admission import admit
from backend.core.errors import KvguardError
from backend.core.pages import PageState
from backend.disagg.errors import HandoffFailed, ProtocolVersionMismatch
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
    AbortAck,
    AbortRequest,
    ErrorInfo,
    HandoffOutcome,
    PrefillRequest,
    PrefillResult,
    TokenRange,
    abort_request_from_wire,
    prefill_request_from_wire,
    to_wire,
)
from backend.verify.decode_side import digest, land
from backend.verify.world import Cell, ChannelError, PrefillHandoff, World, Write
from contracts.lifecycle import Machine

_P = PrefillHandoffState


def _key(instance_id: str, request_id: str) -> str:
    return f"{instance_id}/{request_id}"


def _instance(instance_id: str) -> int:
    return int(instance_id[1:])


def _move(handoff: PrefillHandoff, to: PrefillHandoffState) -> PrefillHandoff:
    machine = Machine(
        "prefill handoff", handoff.request.request_id, PREFILL_TRANSITIONS, handoff.state
    )
    machine.advance(to)
    return replace(handoff, state=machine.state)


def receive(world: World, message: PrefillRequest) -> None:
    world.wire = world.wire - {message}
    try:
        parsed = prefill_request_from_wire(to_wire(message), world.bound.prefill_version)
    except ProtocolVersionMismatch:  # the route refuses it; decode's call raises
        instance = _instance(message.target.instance_id)
        world.send(ChannelError(message.request_id, instance, "protocol_mismatch"))
        return
    key = _key(parsed.target.instance_id, parsed.request_id)
    index = int(parsed.request_id[1:].split(".")[0])
    handoff = PrefillHandoff(parsed, index, _P.RECEIVED, len(parsed.prompt_ids), False)
    if (_instance(parsed.target.instance_id), parsed.request_id) in world.tombstones:
        finish(world, handoff, _P.ABORTED, None)
        return
    tokens, placeholder = len(parsed.prompt_ids), False
    try:
        admit(len(parsed.prompt_ids), parsed.sampling.max_tokens, world.bound.prefill_limits)
    except KvguardError as error:
        if not world.faults.placeholder_on_reject:
            finish(world, handoff, _P.REJECTED, error)
            return
        tokens, placeholder = 1, True  # the drill: a 1-token placeholder, carried on
    world.handoffs[key] = _move(
        replace(handoff, tokens=tokens, placeholder=placeholder), _P.COMPUTING
    )


def computed(world: World, key: str) -> None:
    """The engine finished the prompt (``_compute`` returned): transfer, unless cancelled."""
    handoff = world.handoffs[key]
    if handoff.cancelled:
        finish(world, handoff, _P.ABORTED, None)
        return
    world.handoffs[key] = _move(handoff, _P.TRANSFERRING)


def can_commit(handoff: PrefillHandoff) -> bool:
    return (
        handoff.state in (_P.TRANSFERRING, _P.CANCELLING)
        and not handoff.batch
        and handoff.written < handoff.tokens
        and may_start_batch(cancelled=handoff.cancelled, lease_over=handoff.lease_over)
    )


def commit_batch(world: World, key: str) -> None:
    """Start one batch: from here its writes cannot be recalled."""
    handoff = world.handoffs[key]
    target = handoff.request.target
    if _instance(target.instance_id) != world.instance:  # the endpoint is gone
        error = HandoffFailed(handoff.request.request_id, "transfer failed: endpoint gone")
        finish(world, handoff, _P.FAILED, error)
        return
    end = min(handoff.tokens, handoff.written + target.max_batch_pages)
    batch = tuple(
        Write(world.instance, handoff.request.request_id, handoff.request_index, k, g)
        for k, g in enumerate(handoff.request.pages[:end], start=0)
        if k >= handoff.written
    )
    world.writes = world.writes | set(batch)
    world.events.committed.extend(batch)
    world.handoffs[key] = replace(handoff, batch=batch)


def can_end_transfer(handoff: PrefillHandoff) -> bool:
    if handoff.state not in (_P.TRANSFERRING, _P.CANCELLING) or handoff.batch:
        return False
    return handoff.written >= handoff.tokens or not may_start_batch(
        cancelled=handoff.cancelled, lease_over=handoff.lease_over
    )


def transfer_done(world: World, key: str) -> None:
    """The worker's loop ended with no batch in flight: the code's own terminal decision."""
    handoff = world.handoffs[key]
    failed = lease_cut_short(
        written=handoff.written, total=handoff.tokens, cancelled=handoff.cancelled
    )
    to = transfer_end(handoff.state, written=handoff.written, total=handoff.tokens, failed=failed)
    error = HandoffFailed(handoff.request.request_id, "lease ended") if failed else None
    finish(world, handoff, to, error)


def lease_over(world: World, key: str) -> None:
    """Prefill's clock passes the lease: no batch starts; a prompt still computing fails."""
    handoff = replace(world.handoffs[key], lease_over=True)
    world.handoffs[key] = handoff
    if handoff.state is _P.COMPUTING:
        finish(world, handoff, _P.FAILED, HandoffFailed(handoff.request.request_id, "lease"))


def land_write(world: World, write: Write) -> None:
    """The transport lands one write: into the page's slot (open channel: into the page),
    whoever holds the page now (owners are unseen)."""
    world.writes = world.writes - {write}
    if write.instance == world.instance:
        page = world.pool.page(write.page.page_id)
        current = (
            page.state in (PageState.OWNED, PageState.QUARANTINED)
            and page.generation == write.page.generation
        )
        cell = Cell(
            write.request_index,
            write.position,
            write.handoff_id,
            write.page.generation,
            not current,
        )
        if world.sealed:
            world.landing[write.page.page_id] = cell
        else:
            land(world, cell, write.page.page_id)
    for key, handoff in list(world.handoffs.items()):
        if write in handoff.batch and not (set(handoff.batch) & world.writes):
            world.handoffs[key] = replace(
                handoff, batch=(), written=handoff.written + len(handoff.batch)
            )


def abort(world: World, message: AbortRequest) -> None:
    world.wire = world.wire - {message}
    try:
        parsed = abort_request_from_wire(to_wire(message), world.bound.prefill_version)
    except ProtocolVersionMismatch:
        return  # refused; decode's drain deadline decides
    key = _key(parsed.instance_id, parsed.request_id)
    world.tombstones = world.tombstones | {(_instance(parsed.instance_id), parsed.request_id)}
    handoff = world.handoffs.get(key)
    if handoff is None:
        world.send(
            AbortAck(
                world.bound.prefill_version,
                parsed.request_id,
                parsed.instance_id,
                True,
                "unknown_or_done",
            )
        )
        return
    handoff = replace(handoff, cancelled=True, abort_waiting=True)
    if handoff.state is _P.TRANSFERRING:
        handoff = _move(handoff, _P.CANCELLING)
    world.handoffs[key] = handoff


def ack_timeout(world: World, key: str) -> None:
    """``abort_ack_timeout_s`` passed first: the ack says not quiesced (decode ignores it)."""
    world.handoffs[key] = replace(world.handoffs[key], abort_waiting=False)


def finish(
    world: World, handoff: PrefillHandoff, to: PrefillHandoffState, error: KvguardError | None
) -> None:
    """``_finish``: terminal state, tombstone on ABORTED, the result (and a waiting ack) sent."""
    if handoff.state is not to:
        handoff = _move(handoff, to)
    assert handoff.state in PREFILL_TERMINAL
    request = handoff.request
    key = _key(request.target.instance_id, request.request_id)
    world.handoffs.pop(key, None)
    world.truth[key] = to
    outcome = OUTCOME_OF[to]
    instance = _instance(request.target.instance_id)
    if outcome is HandoffOutcome.ABORTED:
        world.tombstones = world.tombstones | {(instance, request.request_id)}
    info = None if error is None else ErrorInfo(error.code, error.http_status, str(error))
    written = request.pages[: handoff.written] if to is not _P.REJECTED else ()
    ok = to is _P.SUCCEEDED
    world.send(
        PrefillResult(
            world.bound.prefill_version,
            request.request_id,
            request.target.instance_id,
            outcome,
            info,
            TokenRange(0, handoff.tokens) if ok else None,
            written,
            digest([(handoff.request_index, k) for k in range(handoff.tokens)]) if ok else None,
            0 if ok else None,
        )
    )
    if handoff.abort_waiting:
        world.send(
            AbortAck(
                world.bound.prefill_version,
                request.request_id,
                request.target.instance_id,
                True,
                to.value,
            )
        )


def crash(world: World) -> None:
    """Prefill dies and restarts empty: open calls fail, tombstones and handoffs are gone."""
    for handoff in list(world.handoffs.values()):
        request = handoff.request
        world.send(ChannelError(request.request_id, _instance(request.target.instance_id), "lost"))
    for message in list(world.wire):
        if isinstance(message, PrefillRequest):
            instance = _instance(message.target.instance_id)
            world.wire = (world.wire - {message}) | {
                ChannelError(message.request_id, instance, "lost")
            }
        elif isinstance(message, AbortRequest):
            world.wire = world.wire - {message}
    world.handoffs = {}
    world.tombstones = frozenset()
    world.prefill_epoch += 1
    if world.bound.crash_kills_writes:
        world.writes = frozenset()
