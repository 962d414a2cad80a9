"""Decode's moves in the model, mirroring ``DecodeEngineCore`` / ``DecodeScheduler`` step by step.

Each function takes a cloned ``World`` and applies one decode decision with the code's own pieces:
``admit`` for admission, ``PagePool`` for every page move, ``Machine`` over the ``FaultSet``'s
decode table, ``verify_result`` and ``refusal`` for a result. Page memory and the landing slots
are what the model adds: on the sealed channel a handoff's slots are registered at its ticket and
withdrawn at its end, whatever the outcome; a result opens the written pages' chunks from the
slots (a chunk opens only if this handoff sealed it for that position and generation) and only an
accepted result moves them into the pages.
"""

from __future__ import annotations

from collections.abc import Sequence

from backend.core.admission import admit
from backend.core.errors import KvguardError
from backend.core.pages import PageRef
from backend.core.request import TERMINAL, TRANSITIONS, RequestState
from backend.disagg.errors import HandoffTimedOut, PrefillUnavailable, ProtocolVersionMismatch
from backend.disagg.machines import (
    Check,
    DecodeHandoffState,
    Expectation,
    refusal,
    verify_result,
)
from backend.disagg.protocol import (
    PROTOCOL_VERSION,
    AbortAck,
    AbortRequest,
    PageGrant,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    abort_ack_from_wire,
    prefill_result_from_wire,
    to_wire,
)
from backend.verify.world import (
    ADVERSARY,
    MAX_TOKENS,
    WRONG_KEY,
    ZERO_CELL,
    Cause,
    Cell,
    ChannelError,
    World,
)
from contracts.lifecycle import Machine, check_move

_D = DecodeHandoffState
LEASE_S = 1.0
SEAL_KEY = bytes(32)  # the model seals nothing: a chunk's writer stands for its key


def digest(cells: Sequence[tuple[int, int] | None]) -> str:
    """The model's checksum: a digest of the bytes (whose KV, which position), nothing else."""
    return "m:" + ";".join("0" if c is None else f"{c[0]}.{c[1]}" for c in cells)


def _advance(world: World, index: int, to: DecodeHandoffState) -> None:
    request = world.requests[index]
    assert request.handoff is not None
    machine = Machine("handoff", request.handoff_id, world.faults.decode_table, request.handoff)
    machine.advance(to)  # raises InvalidTransition on a move the (fault's) table lacks
    world.set_request(index, handoff=machine.state)


def _end(world: World, index: int, to: RequestState, cause: Cause, error: str | None) -> None:
    state = world.requests[index].state
    assert state is not None and to in TERMINAL
    check_move(TRANSITIONS, "request", world.owners[index].request_id, state, to)
    world.set_request(index, state=to, cause=cause, error_code=error)
    world.events.ended.append(index)


def submit(world: World, index: int, *, stale_view: bool) -> None:
    """A client's request arrives: admission first (the prefill client's cross-role limit)."""
    bound, spec = world.bound, world.bound.requests[index]
    world.set_request(index, state=RequestState.WAITING, instance=world.instance)
    limits = [bound.decode_limits]
    if world.faults.cross_role_admission and not stale_view:
        limits.insert(0, bound.cross_role_limits)
    try:
        for limit in limits:
            admit(spec.prompt_tokens, MAX_TOKENS, limit)
    except KvguardError as error:
        _end(world, index, RequestState.REJECTED, Cause.ADMISSION, error.code)
        return
    world.kv_waiting = (*world.kv_waiting, index)


def can_reserve(world: World) -> bool:
    if not world.kv_waiting:
        return False
    spec = world.bound.requests[world.kv_waiting[0]]
    return world.pool.pages_for(spec.prompt_tokens + MAX_TOKENS) <= world.pool.free_pages


def reserve(world: World) -> None:
    """``DecodeScheduler.reserve_ready`` + ``DecodeEngineCore._reserve`` for the queue's head."""
    index, world.kv_waiting = world.kv_waiting[0], world.kv_waiting[1:]
    spec, owner = world.bound.requests[index], world.owners[index]
    refs = tuple(
        world.writable_pool().allocate(world.pool.pages_for(spec.prompt_tokens + MAX_TOKENS), owner)
    )
    world.sequence += 1
    handoff_id = f"{owner.request_id}.{world.sequence}"
    grants = tuple(PageGrant(r.page_id, r.generation) for r in refs[: spec.prompt_tokens])
    check_move(
        TRANSITIONS, "request", owner.request_id, RequestState.WAITING, RequestState.AWAITING_KV
    )
    world.set_request(
        index,
        state=RequestState.AWAITING_KV,
        handoff=_D.RESERVED,
        handoff_id=handoff_id,
        refs=refs,
    )
    if world.sealed:  # the ticket's slots, for this handoff alone
        world.registered = world.registered | {g.page_id for g in grants}
    _advance(world, index, _D.AWAITING_RESULT)
    world.send(
        PrefillRequest(
            PROTOCOL_VERSION,
            handoff_id,
            owner.tenant,
            tuple(range(spec.prompt_tokens)),
            SamplingSpec(MAX_TOKENS, 0.0, 1.0, None, ()),
            spec.prompt_tokens,
            grants,
            world.target(),
            LEASE_S,
            SEAL_KEY if world.sealed else None,
        )
    )


def _grants(world: World, index: int) -> tuple[PageGrant, ...]:
    request, spec = world.requests[index], world.bound.requests[index]
    return tuple(PageGrant(r.page_id, r.generation) for r in request.refs[: spec.prompt_tokens])


def withdraw(world: World, index: int) -> None:
    """The handoff's slots leave the transport (``Landing.withdraw``)."""
    world.registered = world.registered - {g.page_id for g in _grants(world, index)}


def _free(world: World, refs: tuple[PageRef, ...], index: int) -> None:
    world.writable_pool().free(refs, world.owners[index])
    world.set_request(index, refs=())


def _start_drain(world: World, index: int) -> None:
    request = world.requests[index]
    world.writable_pool().quarantine(request.refs, world.owners[index])
    world.set_request(index, draining=request.refs, refs=())


def release(world: World, index: int) -> None:
    """``release_drain``: bump generations and free the quarantined pages."""
    request = world.requests[index]
    world.writable_pool().release_quarantined(request.draining, world.owners[index])
    world.set_request(index, draining=())
    _advance(world, index, _D.RELEASED)


def deliver(world: World, message: PrefillResult | AbortAck | ChannelError) -> None:
    """A reply reaches decode (after the wire codec, with decode's protocol version)."""
    world.wire = world.wire - {message}
    if isinstance(message, ChannelError):
        if message.instance == world.instance:
            index = world.index_of_handoff(message.handoff_id, message.instance)
            if index is not None:
                lost(world, index, message.kind)
        return
    try:
        if isinstance(message, AbortAck):
            ack = abort_ack_from_wire(to_wire(message))
        else:
            result = prefill_result_from_wire(to_wire(message))
    except ProtocolVersionMismatch:
        if isinstance(message, PrefillResult):
            _lost_by_id(world, message.request_id, message.instance_id, "protocol_mismatch")
        return  # an unreadable ack: the driver logs it and the drain deadline decides
    if isinstance(message, AbortAck):
        index = _index(world, ack.request_id, ack.instance_id)
        if index is not None and ack.quiesced and world.requests[index].handoff is _D.DRAINING:
            release(world, index)
        return
    index = _index(world, result.request_id, result.instance_id)
    if index is None:
        return  # a late result for a handoff this instance no longer knows
    if world.requests[index].handoff is _D.DRAINING:
        release(world, index)  # a result means prefill is quiescent for it
    elif world.requests[index].handoff is _D.AWAITING_RESULT:
        _complete(world, index, result)


def _index(world: World, handoff_id: str, instance_id: str) -> int | None:
    if instance_id != f"d{world.instance}":
        return None  # another (dead) decode incarnation's message
    return world.index_of_handoff(handoff_id, world.instance)


def _lost_by_id(world: World, handoff_id: str, instance_id: str, kind: str) -> None:
    index = _index(world, handoff_id, instance_id)
    if index is not None:
        lost(world, index, kind)


def _complete(world: World, index: int, result: PrefillResult) -> None:
    request, spec, owner = world.requests[index], world.bound.requests[index], world.owners[index]
    withdraw(world, index)
    _advance(world, index, _D.VERIFYING)
    grants = _grants(world, index)
    expect = Expectation(request.handoff_id, f"d{world.instance}", spec.prompt_tokens, grants)
    pool, memory = world.pool, world.memory
    enforced = world.faults.enforced_checks
    if not world.sealed:
        enforced = enforced - {Check.SEAL}
    written = _written(grants, result) if world.sealed else ()
    opened = {k: _open(world.landing[grants[k].page_id], request.handoff_id, k) for k in written}

    def pages_current(asked: Sequence[PageGrant]) -> bool:
        return all(pool.is_current(PageRef(g.page_id, g.generation), owner) for g in asked)

    def unsealed() -> str | None:
        refused = [k for k in written if not opened[k][1]]
        return None if not refused else f"page {refused[0]} of the prompt is not sealed for it"

    def local_checksum() -> str:
        if not world.sealed:
            return digest([memory[g.page_id].content for g in grants])
        return digest(
            [
                opened[k][0].content if k in opened else memory[g.page_id].content
                for k, g in enumerate(grants)
            ]
        )

    verdict = verify_result(
        expect,
        result,
        enforced=enforced,
        pages_current=pages_current,
        unsealed=unsealed,
        local_checksum=local_checksum,
    )
    if verdict.accepted:
        for k, (cell, _) in opened.items():  # every check passed: the move into the pages
            land(world, cell, grants[k].page_id)
        _advance(world, index, _D.ACCEPTED)
        world.set_request(index, state=RequestState.DECODING)
        world.events.accepted.append(index)
        return
    to, error = refusal(request.handoff_id, result, verdict)
    _end(world, index, to, Cause.PREFILL_REPLY, None if error is None else error.code)
    _free(world, request.refs, index)
    _advance(world, index, _D.RELEASED)


def _written(grants: tuple[PageGrant, ...], result: PrefillResult) -> tuple[int, ...]:
    """The positions prefill reports written: the granted pages it names, from the first on
    (``DecodeEngineCore._unseal``). The model seals page by page: a real chunk covers a run of
    pages, and a byte changed in any of them fails the run, which refuses the same handoff."""
    reported, written = result.pages_written, 0
    while written < min(len(reported), len(grants)) and reported[written] == grants[written]:
        written += 1
    return tuple(range(written))


def _open(slot: Cell, handoff_id: str, position: int) -> tuple[Cell, bool]:
    """What opening a slot yields, and whether its seal held: only this handoff's chunk for this
    position opens; without the check (a drill) an adversary's bytes pass as they are (the
    cipher is malleable) and another key's chunk becomes noise."""
    if slot.writer == handoff_id and slot.position == position and slot.content is not None:
        return slot, True
    if slot.writer == ADVERSARY:
        return slot, False
    return Cell(None, 0, slot.writer + WRONG_KEY, slot.generation, slot.late), False


def lost(world: World, index: int, kind: str) -> None:
    """``DecodeEngineCore.lost``: no readable result will come; fail and drain (no abort sent)."""
    if world.requests[index].handoff is not _D.AWAITING_RESULT:
        return
    errors: dict[str, KvguardError] = {
        "timeout": HandoffTimedOut(world.requests[index].handoff_id, LEASE_S),
        "protocol_mismatch": ProtocolVersionMismatch(PROTOCOL_VERSION, "other", "prefill"),
        "lost": PrefillUnavailable("connection lost during the handoff"),
    }
    withdraw(world, index)
    _advance(world, index, _D.DRAINING)
    _end(world, index, RequestState.FAILED, Cause.LOST, errors[kind].code)
    _start_drain(world, index)


def client_abort(world: World, index: int) -> None:
    """``DecodeEngineCore.abort`` (client gone) for a waiting, awaiting or decoding request."""
    request = world.requests[index]
    if index in world.kv_waiting:
        world.kv_waiting = tuple(i for i in world.kv_waiting if i != index)
        _end(world, index, RequestState.ABORTED, Cause.CLIENT_ABORT, None)
        return
    _end(world, index, RequestState.ABORTED, Cause.CLIENT_ABORT, None)
    if request.handoff is not _D.AWAITING_RESULT:  # DECODING: the base scheduler frees at once
        _free(world, request.refs, index)
        return
    withdraw(world, index)
    if world.faults.early_release:
        _advance(world, index, _D.RELEASED)  # only the drill's table has this move
        _free(world, request.refs, index)
    else:
        _advance(world, index, _D.DRAINING)
        _start_drain(world, index)
    world.send(AbortRequest(PROTOCOL_VERSION, request.handoff_id, f"d{world.instance}"))


def decode_step(world: World, index: int) -> None:
    """The first decode step: read the prompt's KV (``PagePool.verify`` first), then finish."""
    request, spec, owner = world.requests[index], world.bound.requests[index], world.owners[index]
    prompt_refs = request.refs[: spec.prompt_tokens]
    world.pool.verify(prompt_refs, owner)  # the runner's read-path check
    world.events.read.append((index, tuple(world.memory[r.page_id] for r in prompt_refs)))
    world.set_request(index, read=True)
    _end(world, index, RequestState.FINISHED, Cause.FINISHED, None)
    _free(world, request.refs, index)


def confirm_zeroed(world: World) -> None:
    """The engine zeroes every PENDING_ZERO page, then tells the pool."""
    pool = world.writable_pool()
    ids = [p for p in range(pool.num_pages) if pool.page(p).state.value == "pending_zero"]
    for page_id in ids:
        world.memory[page_id] = ZERO_CELL
    pool.confirm_zeroed(ids)


def decode_crash(world: World) -> None:
    """Decode dies and restarts: a new instance, a fresh pool and memory; its clients get errors."""
    from backend.verify.world import new_pool

    for index, request in enumerate(world.requests):
        if request.state is not None and request.state not in TERMINAL:
            world.set_request(index, state=RequestState.FAILED, cause=Cause.DECODE_CRASH)
            world.set_request(index, error_code="decode_restarted")
            world.events.ended.append(index)
        world.set_request(index, handoff=None, refs=(), draining=())  # the books died with it
    world.instance += 1
    world.sequence = 0
    world.kv_waiting = ()
    world.pool, world.pool_shared = new_pool(world.bound, world.faults), False
    world.memory = [ZERO_CELL] * world.bound.decode_pages
    world.landing = [ZERO_CELL] * world.bound.decode_pages
    world.registered, world.adversary = frozenset(), frozenset()  # its memory died with it


def land(world: World, cell: Cell, page_id: int) -> None:
    world.memory[page_id] = cell
