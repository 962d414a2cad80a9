"""Every move the world can make next: decode, prefill, the transport and the environment.

``successors`` yields ``(label, world)`` for each enabled action, the world already cloned and
moved. Labels are what a counterexample trace prints. Environment moves are budgeted by the
``Bound``: client aborts, result timeouts, role crashes, stale capacity views and the writes of
an adversary on the transfer port (into any registered memory, landing whenever it likes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from backend.core.request import RequestState
from backend.disagg.machines import DecodeHandoffState, PrefillHandoffState, may_start_batch
from backend.disagg.protocol import AbortAck, AbortRequest, PrefillRequest, PrefillResult
from backend.verify import adversary, decode_side, prefill_side
from backend.verify.world import ChannelError, World, Write

_D = DecodeHandoffState
_P = PrefillHandoffState
Move = Callable[[World], None]


def successors(world: World) -> Iterator[tuple[str, World]]:
    for label, move in enabled(world):
        nxt = world.clone()
        move(nxt)
        yield label, nxt


def enabled(world: World) -> list[tuple[str, Move]]:
    return [
        *_decode_moves(world),
        *_prefill_moves(world),
        *_wire_moves(world),
        *_env_moves(world),
        *_adversary_moves(world),
    ]


def _spend(slot: int, move: Move) -> Move:
    def spent(world: World) -> None:
        budget = list(world.budget)
        budget[slot] -= 1
        world.budget = (budget[0], budget[1], budget[2], budget[3], budget[4], budget[5])
        move(world)

    return spent


def _decode_moves(world: World) -> list[tuple[str, Move]]:
    moves: list[tuple[str, Move]] = []
    for i, request in enumerate(world.requests):
        name = world.owners[i].request_id
        if request.state is None:
            moves.append((f"submit {name}", _submit(i, stale=False)))
            if world.budget[4] > 0 and world.faults.cross_role_admission:
                moves.append((f"submit {name} (stale capacity view)", _spend(4, _submit(i, True))))
        if request.state is RequestState.DECODING and not request.read:
            moves.append((f"decode step {name} (reads KV)", _step(i)))
        if request.handoff is _D.DRAINING and _drain_deadline_passed(world, i):
            moves.append((f"drain deadline {name}", _release(i)))
    if decode_side.can_reserve(world):
        moves.append(("decode reserves pages", decode_side.reserve))
    if world.pool.pending_zero_pages:
        moves.append(("zero freed pages", decode_side.confirm_zeroed))
    return moves


def _submit(index: int, stale: bool) -> Move:
    return lambda world: decode_side.submit(world, index, stale_view=stale)


def _step(index: int) -> Move:
    return lambda world: decode_side.decode_step(world, index)


def _release(index: int) -> Move:
    return lambda world: decode_side.release(world, index)


def _drain_deadline_passed(world: World, index: int) -> bool:
    """The timing assumption behind ``release_deadline`` (lease end + drain bound), made explicit.

    By then prefill's lease is over, so it starts no batch; the one batch that may be in flight
    has landed (the drain bound); and the PrefillRequest itself is not still on the wire (message
    delay within the slack). Untimed, the deadline may pass at any moment where all that holds.
    """
    request = world.requests[index]
    if any(
        w.handoff_id == request.handoff_id and w.instance == world.instance for w in world.writes
    ):
        return False
    if any(
        isinstance(m, PrefillRequest) and m.request_id == request.handoff_id for m in world.wire
    ):
        return False
    handoff = world.handoffs.get(f"d{world.instance}/{request.handoff_id}")
    if handoff is None:
        return True
    return not may_start_batch(cancelled=handoff.cancelled, lease_over=handoff.lease_over)


def _prefill_moves(world: World) -> list[tuple[str, Move]]:
    moves: list[tuple[str, Move]] = []
    for key, handoff in sorted(world.handoffs.items()):
        if handoff.state is _P.COMPUTING:
            moves.append((f"prefill computed {key}", _on(prefill_side.computed, key)))
        if prefill_side.can_commit(handoff):
            moves.append((f"prefill commits a batch {key}", _on(prefill_side.commit_batch, key)))
        if prefill_side.can_end_transfer(handoff):
            moves.append((f"prefill transfer ends {key}", _on(prefill_side.transfer_done, key)))
        if not handoff.lease_over:
            moves.append((f"prefill lease over {key}", _on(prefill_side.lease_over, key)))
        if handoff.abort_waiting:
            moves.append((f"prefill abort-ack times out {key}", _on(prefill_side.ack_timeout, key)))
    return moves


def _on(action: Callable[[World, str], None], key: str) -> Move:
    return lambda world: action(world, key)


def _wire_moves(world: World) -> list[tuple[str, Move]]:
    moves: list[tuple[str, Move]] = []
    for write in sorted(world.writes, key=repr):
        label = (
            f"write lands: d{write.instance} page {write.page.page_id} gen "
            f"{write.page.generation} <- {write.handoff_id}[{write.position}]"
        )
        moves.append((label, _land(write)))
    for message in sorted(world.wire, key=repr):
        moves.append((f"deliver {describe(message)}", _deliver(message)))
    return moves


def _land(write: Write) -> Move:
    return lambda world: prefill_side.land_write(world, write)


def _deliver(message: object) -> Move:
    if isinstance(message, PrefillRequest):
        return lambda world: prefill_side.receive(world, message)
    if isinstance(message, AbortRequest):
        return lambda world: prefill_side.abort(world, message)
    assert isinstance(message, PrefillResult | AbortAck | ChannelError)
    return lambda world: decode_side.deliver(world, message)


def _env_moves(world: World) -> list[tuple[str, Move]]:
    moves: list[tuple[str, Move]] = []
    aborts, timeouts, p_crashes, d_crashes, _, _ = world.budget
    for i, request in enumerate(world.requests):
        name = world.owners[i].request_id
        live = request.state in (
            RequestState.WAITING,
            RequestState.AWAITING_KV,
            RequestState.DECODING,
        )
        if aborts > 0 and live:
            moves.append((f"client aborts {name}", _spend(0, _abort(i))))
        if timeouts > 0 and request.handoff is _D.AWAITING_RESULT:
            moves.append((f"result deadline passes {name}", _spend(1, _timeout(i))))
    if p_crashes > 0:
        moves.append(("prefill crashes and restarts", _spend(2, prefill_side.crash)))
    if d_crashes > 0:
        moves.append(("decode crashes and restarts", _spend(3, decode_side.decode_crash)))
    return moves


def _adversary_moves(world: World) -> list[tuple[str, Move]]:
    """A peer of the transfer port: it starts a write into any memory registered now (the
    sealed channel: a handoff's slots; the open channel: the pages of any request), and each
    lands whenever it likes -- after the memory was withdrawn too."""
    moves: list[tuple[str, Move]] = []
    where = "slot" if world.sealed else "page"
    if world.budget[5] > 0:
        for target in sorted(adversary.reachable(world) - world.adversary):
            moves.append(
                (f"adversary starts a write into {where} {target}", _spend(5, _aim(target)))
            )
    for target in sorted(world.adversary):
        moves.append((f"adversary write lands in {where} {target}", _hit(target)))
    return moves


def _aim(target: int) -> Move:
    return lambda world: adversary.start_write(world, target)


def _hit(target: int) -> Move:
    return lambda world: adversary.land_write(world, target)


def _abort(index: int) -> Move:
    return lambda world: decode_side.client_abort(world, index)


def _timeout(index: int) -> Move:
    return lambda world: decode_side.lost(world, index, "timeout")


def describe(message: object) -> str:
    """A message as a trace line: type, ids and the fields the checks read (no token ids)."""
    if isinstance(message, PrefillRequest):
        pages = ",".join(f"{g.page_id}@{g.generation}" for g in message.pages)
        return (
            f"PrefillRequest(v{message.protocol_version} {message.target.instance_id}/"
            f"{message.request_id} tenant={message.tenant} reserved={message.reserved_tokens} "
            f"pages=[{pages}])"
        )
    if isinstance(message, PrefillResult):
        pages = ",".join(f"{g.page_id}@{g.generation}" for g in message.pages_written)
        span = "-" if message.transferred is None else f"[0,{message.transferred.end})"
        error = "" if message.error is None else f" error={message.error.code}"
        return (
            f"PrefillResult(v{message.protocol_version} {message.instance_id}/"
            f"{message.request_id} {message.outcome.value} transferred={span} "
            f"written=[{pages}] checksum={message.checksum}{error})"
        )
    if isinstance(message, AbortRequest):
        return (
            f"AbortRequest(v{message.protocol_version} {message.instance_id}/{message.request_id})"
        )
    if isinstance(message, AbortAck):
        return (
            f"AbortAck(v{message.protocol_version} {message.instance_id}/{message.request_id} "
            f"quiesced={message.quiesced} state={message.state})"
        )
    assert isinstance(message, ChannelError)
    return f"ChannelError(d{message.instance}/{message.handoff_id} {message.kind})"
