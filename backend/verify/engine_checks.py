"""The engine model's invariants, judged after every move, and how a world prints in a trace.

7. ``shared-one-salt``: a page that two live requests can read belongs to one tenant's salt: their
   tenants are one tenant, or in one group of the operator's ``prefix_cache_groups`` (the intended
   configuration, read from the bound, not from the code under test).
8. ``preempted-unread``: a page a preemption gave back is never read before it was zeroed (and,
   to be read at all, allocated again: ``PagePool.verify``).
9. ``own-kv``: every position a step reads holds the K/V of the reader's own tokens up to it (a
   cache hit reads the same tokens computed by a request of its own scope).
10. ``answers``: a finished request's output is what it computes alone, unpreempted and uncached;
   no request fails (an isolation refusal in these bounds would be a bookkeeping bug).
``p1-engine-books``: ``Scheduler.check_invariants`` (queues, page tables, pool, cache index).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from backend.core.errors import InvariantViolation
from backend.core.pages import PageState
from backend.core.request import TERMINAL, RequestState
from backend.verify.engine_world import Content, EngineWorld
from backend.verify.invariants import Invariant


def _shared_one_salt(world: EngineWorld) -> str | None:
    pool, bound = world.sched.pool, world.bound
    readers: dict[int, list[int]] = {}
    for index, request in enumerate(world.requests):
        if request.state in TERMINAL:
            continue
        for ref in request.page_table:
            if pool.is_current(ref, request.owner):
                readers.setdefault(ref.page_id, []).append(index)
    for page_id, who in sorted(readers.items()):
        tenants = sorted({world.requests[i].tenant for i in who})
        if len({bound.intended_scope(t) for t in tenants}) > 1:
            names = ", ".join(world.requests[i].request_id for i in who)
            return f"page {page_id} is readable by {names} of tenants {', '.join(tenants)}"
    return None


def _preempted_unread(world: EngineWorld) -> str | None:
    for index, position, page_id, _ in world.events.read:
        if page_id in world.stale:
            victim = world.requests[world.stale[page_id]].request_id
            reader = world.requests[index].request_id
            return (
                f"{reader} read page {page_id} (position {position}), which {victim}'s "
                "preemption gave back and nobody zeroed since"
            )
    return None


def _own_kv(world: EngineWorld) -> str | None:
    for index, position, page_id, content in world.events.read:
        want = world.requests[index].token_ids(0, position + 1)
        if content != want:
            reader = world.requests[index].request_id
            return f"{reader} read position {position} from page {page_id}: {_show(content)}"
    return None


def _answers(world: EngineWorld) -> str | None:
    for index, reason in world.events.failed:
        return f"{world.requests[index].request_id} failed its read check ({reason})"
    for request, spec in zip(world.requests, world.bound.requests, strict=True):
        if request.state is RequestState.FINISHED and tuple(request.output_ids) != spec.answer():
            return f"{request.request_id} answered {request.output_ids}, not {list(spec.answer())}"
    return None


def _books(world: EngineWorld) -> str | None:
    try:
        world.sched.check_invariants()
    except InvariantViolation as error:
        return str(error)
    return None


CHECKS: Mapping[Invariant, Callable[[EngineWorld], str | None]] = MappingProxyType(
    {
        Invariant.SHARED_ONE_SALT: _shared_one_salt,
        Invariant.PREEMPTED_UNREAD: _preempted_unread,
        Invariant.OWN_KV: _own_kv,
        Invariant.ANSWERS: _answers,
        Invariant.ENGINE_BOOKS: _books,
    }
)


def first_violation(
    world: EngineWorld, which: frozenset[Invariant]
) -> tuple[Invariant, str] | None:
    for invariant, check in CHECKS.items():
        if invariant in which:
            problem = check(world)
            if problem is not None:
                return invariant, problem
    return None


def render(world: EngineWorld) -> str:
    lines = []
    for index, request in enumerate(world.requests):
        state = request.state.value if world.submitted[index] else "not sent"
        pages = ",".join(str(ref.page_id) for ref in request.page_table)
        lines.append(
            f"  {request.request_id} (tenant {request.tenant}): {state} out={request.output_ids} "
            f"pages=[{pages}] computed={request.num_computed_tokens}"
        )
    pool = world.sched.pool
    cells = []
    for page_id in range(pool.num_pages):
        page = pool.page(page_id)
        if page.state is PageState.SHARED:
            holder = "+".join(sorted(o.request_id for o in page.readers)) or "idle"
        else:
            holder = page.owner.request_id if page.owner else "-"
        held = "/".join(_show(c) for c in world.memory[page_id])
        mark = "!" if page_id in world.stale else ""
        cells.append(f"{page_id}:{page.state.value}/g{page.generation}/{holder}/{held}{mark}")
    lines.append("  pages: " + "  ".join(cells))
    return "\n".join(lines)


def _show(content: Content) -> str:
    return "0" if content is None else "".join(map(str, content))
