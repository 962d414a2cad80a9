"""The named safety properties (issue 10 numbering), judged on each new state and its last move.

1. ``evidence``: decode admits KV only if prefill's outcome was OK, every reserved prompt position
   holds this handoff's KV (transferred == reserved), written at the granted, still-current
   generation, by a prefill on decode's protocol version (so the checksum can match).
2. ``owner_reads``: a read passes ``PagePool.verify`` and sees no KV of any other request.
3. ``no_free_under_write``: a page with a write in flight is held (OWNED or QUARANTINED) at that
   write's generation: it never reached the free list meanwhile.
4. ``no_late_read``: no read sees a write that landed after its page's generation changed.
5. ``rejection``: a request some role's admission refuses ends REJECTED with the admission
   error's code (or ABORTED/FAILED by a client or a lost peer), never accepted, never FAILED by
   a refused handoff; when it ends REJECTED it holds no page.
6. ``versions``: with mismatched protocol versions no write is committed and nothing is accepted.
11. ``own_transfer``: every byte a decode step reads came from its own request's prefill transfer
    (written by its own handoff): never from a peer of the transfer port, never another's.
12. ``no_exposure``: no page of decode's pool is reachable from the transfer port while it holds
    KV, and a landing slot is registered only while the handoff that holds its page awaits its
    result (registered for that handoff alone, withdrawn at its end whatever the outcome).

``P0`` (``pool_books``): the real ``PagePool.check_invariants`` after every move.

Properties 7-10 and ``p1`` are the engine model's (shared and preempted pages in one unified
engine): ``backend.verify.engine_checks`` judges them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from types import MappingProxyType

from backend.core.admission import admit
from backend.core.errors import InvariantViolation, KvguardError
from backend.core.pages import PageRef, PageState
from backend.core.request import RequestState
from backend.disagg.machines import DecodeHandoffState, PrefillHandoffState
from backend.disagg.protocol import PROTOCOL_VERSION
from backend.verify.world import MAX_TOKENS, Cause, Cell, World


class Invariant(StrEnum):
    EVIDENCE = "1-evidence"
    OWNER_READS = "2-owner-reads"
    NO_FREE_UNDER_WRITE = "3-no-free-under-write"
    NO_LATE_READ = "4-no-late-read"
    REJECTION = "5-rejection"
    VERSIONS = "6-versions"
    OWN_TRANSFER = "11-own-transfer"
    NO_EXPOSURE = "12-no-exposure"
    POOL_BOOKS = "p0-pool-books"
    # the engine model (backend.verify.engine_checks)
    SHARED_ONE_SALT = "7-shared-one-salt"
    PREEMPTED_UNREAD = "8-preempted-unread"
    OWN_KV = "9-own-kv"
    ANSWERS = "10-answers"
    ENGINE_BOOKS = "p1-engine-books"


ALL_INVARIANTS = frozenset(Invariant)


def refused_code(world: World, index: int) -> str | None:
    """The admission error's code if some role can never serve request ``index``."""
    spec = world.bound.requests[index]
    for limits in (world.bound.decode_limits, world.bound.prefill_limits):
        try:
            admit(spec.prompt_tokens, MAX_TOKENS, limits)
        except KvguardError as error:
            return error.code
    return None


def _evidence(world: World) -> str | None:
    for index in world.events.accepted:
        request, spec = world.requests[index], world.bound.requests[index]
        owner, key = world.owners[index], f"d{world.instance}/{request.handoff_id}"
        if world.truth.get(key) is not PrefillHandoffState.SUCCEEDED:
            return f"{owner.request_id} accepted although prefill ended {world.truth.get(key)}"
        for position, ref in enumerate(request.refs[: spec.prompt_tokens]):
            cell = world.memory[ref.page_id]
            want = (index, position)
            if cell.content != want or cell.writer != request.handoff_id or cell.late:
                return (
                    f"{owner.request_id} accepted; prompt position {position} (page "
                    f"{ref.page_id}) holds {_show(cell)}, not its own KV"
                )
            if not world.pool.is_current(PageRef(ref.page_id, ref.generation), owner):
                return f"{owner.request_id} accepted with page {ref.page_id} not current"
    return None


def _owner_reads(world: World) -> str | None:
    for index, cells in world.events.read:
        for cell in cells:
            if cell.request_index is not None and cell.request_index != index:
                owner = world.owners[index]
                other = world.owners[cell.request_index]
                return (
                    f"{owner.request_id} (tenant {owner.tenant}) read KV of {other.request_id} "
                    f"(tenant {other.tenant}): {_show(cell)}"
                )
    return None


def _no_free_under_write(world: World) -> str | None:
    for write in world.writes:
        if write.instance != world.instance:
            continue
        page = world.pool.page(write.page.page_id)
        held = page.state in (PageState.OWNED, PageState.QUARANTINED)
        if not held or page.generation != write.page.generation:
            return (
                f"page {write.page.page_id} is {page.state.value} at generation "
                f"{page.generation} while {write.handoff_id}'s write for generation "
                f"{write.page.generation} is in flight"
            )
    return None


def _no_late_read(world: World) -> str | None:
    for index, cells in world.events.read:
        for cell in cells:
            if cell.late:
                return f"{world.owners[index].request_id} read a late write: {_show(cell)}"
    return None


def _rejection(world: World) -> str | None:
    for index in [*world.events.ended, *world.events.accepted]:
        code = refused_code(world, index)
        if code is None:
            continue
        request, name = world.requests[index], world.owners[index].request_id
        if request.state in (RequestState.DECODING, RequestState.FINISHED):
            return f"{name} is over-long ({code}) yet was served ({request.state.value})"
        by_refusal = request.cause in (Cause.ADMISSION, Cause.PREFILL_REPLY)
        if by_refusal and (
            request.state is not RequestState.REJECTED or request.error_code != code
        ):
            return (
                f"{name} was refused by admission ({code}) but ended "
                f"{request.state.value if request.state else None} with {request.error_code}"
            )
        if request.state is RequestState.REJECTED and (request.refs or request.draining):
            return f"{name} ended REJECTED still holding pages"
    return None


def _versions(world: World) -> str | None:
    if world.bound.prefill_version == PROTOCOL_VERSION:
        return None
    if world.events.committed:
        return f"prefill v{world.bound.prefill_version} wrote KV for a v{PROTOCOL_VERSION} decode"
    if world.events.accepted:
        return "decode accepted KV from a prefill on another protocol version"
    return None


def _own_transfer(world: World) -> str | None:
    for index, cells in world.events.read:
        request = world.requests[index]
        for position, cell in enumerate(cells):
            if cell.writer != request.handoff_id:
                writer = cell.writer or "nobody (the page's old bytes)"
                return (
                    f"{world.owners[index].request_id} read prompt position {position} written "
                    f"by {writer}, not by its own transfer {request.handoff_id}"
                )
    return None


def _no_exposure(world: World) -> str | None:
    if not world.sealed:
        for page_id, cell in enumerate(world.memory):
            if cell.content is not None:
                return f"page {page_id} holds {_show(cell)} and is registered with the transport"
        return None
    awaiting = {
        ref.page_id
        for index, request in enumerate(world.requests)
        if request.handoff is DecodeHandoffState.AWAITING_RESULT
        for ref in request.refs[: world.bound.requests[index].prompt_tokens]
    }
    stray = sorted(world.registered - awaiting)
    if stray:
        return f"landing slot {stray[0]} is registered with no handoff awaiting its page"
    return None


def _pool_books(world: World) -> str | None:
    try:
        world.pool.check_invariants()
    except InvariantViolation as error:
        return str(error)
    return None


CHECKS: Mapping[Invariant, Callable[[World], str | None]] = MappingProxyType(
    {
        Invariant.EVIDENCE: _evidence,
        Invariant.OWNER_READS: _owner_reads,
        Invariant.NO_FREE_UNDER_WRITE: _no_free_under_write,
        Invariant.NO_LATE_READ: _no_late_read,
        Invariant.REJECTION: _rejection,
        Invariant.VERSIONS: _versions,
        Invariant.OWN_TRANSFER: _own_transfer,
        Invariant.NO_EXPOSURE: _no_exposure,
        Invariant.POOL_BOOKS: _pool_books,
    }
)


def first_violation(world: World, which: frozenset[Invariant]) -> tuple[Invariant, str] | None:
    for invariant, check in CHECKS.items():
        if invariant in which:
            problem = check(world)
            if problem is not None:
                return invariant, problem
    return None


def _show(cell: Cell) -> str:
    if cell.request_index is None:
        return "zeros"
    late = ", landed late" if cell.late else ""
    return (
        f"KV of r{cell.request_index}[{cell.position}] written by {cell.writer} for generation "
        f"{cell.generation}{late}"
    )
