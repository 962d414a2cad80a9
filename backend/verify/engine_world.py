"""The engine model: one unified engine with on-demand pages, preemption and the prefix cache.

What is the code's own (imported, never copied): the ``Scheduler`` (admission, queues, page growth,
the stated preemption order, publishing to the cache), its ``KVManager`` and ``PrefixCache`` with
``CacheScopes`` (per tenant, operator groups, or the drill's one scope from the ``FaultSet``), the
``PagePool`` (SHARED pages, readers, generations, zero-on-free gating) and ``PagePool.verify``
with ``writes_from``, the read-path check the engine core runs before every forward.

What is modelled here, because it lies outside the code: page memory (each slot holds the K/V of
a token prefix, or zeros), the model runner (a step writes K/V for its positions
``[start, end)`` into the request's pages, then reads every position ``[0, end)``, and samples a
token that is a function of the K/V at the last one), clients that arrive in any order and abort
at any moment between steps.

One engine step is one move (schedule -> zero -> verify -> run -> postprocess, as
``EngineCore.step``); the world records what the step read and which pages a preemption released,
for ``engine_checks``. ``key`` is the world's canonical fingerprint.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field

from backend.core.admission import CapacityLimits
from backend.core.errors import IsolationError, KvguardError
from backend.core.messages import DecodeItem, PrefillChunk
from backend.core.pages import PagePool, PageState
from backend.core.prefix_cache import CacheScopes
from backend.core.request import TERMINAL, Request, RequestState, SamplingParams
from backend.core.scheduler import Scheduler
from backend.disagg.faults import FaultSet

# What a memory slot holds: the token prefix whose K/V it is (position = its length - 1), or None.
Content = tuple[int, ...] | None
_KEY = b"model-checker-scope-key!"
VOCAB = 3


def sample(content: Content) -> int:
    """The model's next token, a function of the K/V it read at the last position."""
    tokens = content or ()
    return sum((i + 1) * t for i, t in enumerate(tokens)) % VOCAB + 1


@dataclass(frozen=True, slots=True)
class EngineRequestSpec:
    tenant: str
    prompt: tuple[int, ...]
    max_tokens: int

    def answer(self) -> tuple[int, ...]:
        """What this request computes alone, unpreempted and uncached."""
        tokens = list(self.prompt)
        for _ in range(self.max_tokens):
            tokens.append(sample(tuple(tokens)))
        return tuple(tokens[len(self.prompt) :])


@dataclass(frozen=True, slots=True)
class EngineBound:
    """One engine's finite instance: requests, pool, batch limits and client aborts."""

    name: str
    requests: tuple[EngineRequestSpec, ...]
    pages: int
    page_size: int
    max_running: int
    max_batch_tokens: int
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()  # the operator's prefix-cache groups
    client_aborts: int = 0
    zero_on_free: bool = True
    watermark: int = 0  # pages a new admission leaves free while others run

    def intended_scope(self, tenant: str) -> str:
        """The namespace the configuration intends a tenant to use (independent of the code)."""
        for group, tenants in self.groups:
            if tenant in tenants:
                return "group:" + group
        return "tenant:" + tenant


@dataclass(slots=True)
class EngineEvents:
    read: list[tuple[int, int, int, Content]] = field(default_factory=list)  # who, position, page
    failed: list[tuple[int, str]] = field(default_factory=list)


@dataclass(slots=True)
class EngineWorld:
    bound: EngineBound
    faults: FaultSet
    sched: Scheduler
    requests: list[Request]
    submitted: tuple[bool, ...]
    memory: list[tuple[Content, ...]]
    stale: dict[int, int]  # page -> request whose preemption released it, until it is zeroed
    aborts: int
    events: EngineEvents = field(default_factory=EngineEvents)

    @classmethod
    def initial(cls, bound: EngineBound, faults: FaultSet) -> EngineWorld:
        zero = faults.zero_on_free(bound.zero_on_free)
        pool = PagePool(bound.pages, bound.page_size, zero_on_free=zero)
        groups = {name: tenants for name, tenants in bound.groups}
        scopes = CacheScopes.from_groups(_KEY, groups, per_tenant=faults.per_tenant_cache_scopes)
        sched = Scheduler(
            pool,
            CapacityLimits.from_pool(pool, bound.pages * bound.page_size),
            max_batch_tokens=bound.max_batch_tokens,
            max_running=bound.max_running,
            watermark=bound.watermark,
            cache_scopes=scopes,
        )
        requests = [
            Request(f"r{i}", spec.tenant, spec.prompt, SamplingParams(spec.max_tokens))
            for i, spec in enumerate(bound.requests)
        ]
        empty = (None,) * bound.page_size
        return cls(
            bound,
            faults,
            sched,
            requests,
            (False,) * len(requests),
            [empty] * bound.pages,
            {},
            bound.client_aborts,
        )

    def clone(self) -> EngineWorld:
        memo: dict[int, object] = {id(self.sched.limits): self.sched.limits}
        sched, requests = copy.deepcopy((self.sched, self.requests), memo)
        return EngineWorld(
            self.bound,
            self.faults,
            sched,
            requests,
            self.submitted,
            list(self.memory),
            dict(self.stale),
            self.aborts,
        )

    def key(self) -> tuple[object, ...]:
        states = tuple(r.state for r in self.requests)
        stale = tuple(sorted(self.stale.items()))
        memory = tuple(self.memory)
        return self.sched.fingerprint(), states, self.submitted, memory, stale, self.aborts

    def done(self) -> bool:
        """Every request sent and terminal, nothing to zero, every page free or cached unread."""
        pool = self.sched.pool
        return (
            all(self.submitted)
            and all(r.state in TERMINAL for r in self.requests)
            and not self.sched.has_work()
            and pool.owned_pages == pool.quarantined_pages == pool.pending_zero_pages == 0
            and pool.shared_reads == 0
        )


def successors(world: EngineWorld) -> Iterator[tuple[str, EngineWorld]]:
    for index, request in enumerate(world.requests):
        if not world.submitted[index]:
            yield (
                f"submit {request.request_id} (tenant {request.tenant})",
                _moved(world, lambda w, i=index: _submit(w, i)),
            )
        elif world.aborts > 0 and request.state not in TERMINAL:
            yield (
                f"client aborts {request.request_id}",
                _moved(world, lambda w, i=index: _abort(w, i)),
            )
    if world.sched.has_work():
        yield "engine step", _moved(world, _step)


def _moved(world: EngineWorld, move: object) -> EngineWorld:
    nxt = world.clone()
    assert callable(move)
    move(nxt)
    return nxt


def _submit(world: EngineWorld, index: int) -> None:
    flags = list(world.submitted)
    flags[index] = True
    world.submitted = tuple(flags)
    # An over-long request is REJECTED before any page (the scheduler tests pin that).
    with contextlib.suppress(KvguardError):
        world.sched.add(world.requests[index])


def _abort(world: EngineWorld, index: int) -> None:
    world.aborts -= 1
    world.sched.abort(world.requests[index].request_id)


def _step(world: EngineWorld) -> None:
    """``EngineCore.step`` with the runner played over the modelled memory."""
    sched, pool = world.sched, world.sched.pool
    before = [(r.state, r.page_table) for r in world.requests]
    output = sched.schedule()
    for index, request in enumerate(world.requests):
        was, table = before[index]
        if request.state is RequestState.PREEMPTED and was is not RequestState.PREEMPTED:
            for ref in table:  # the pages its preemption gave back (cached ones stay cached)
                page = pool.page(ref.page_id)
                if page.state is not PageState.SHARED or page.generation != ref.generation:
                    world.stale[ref.page_id] = index
    for page_id in output.pages_to_zero:
        world.memory[page_id] = (None,) * world.bound.page_size
        world.stale.pop(page_id, None)
    pool.confirm_zeroed(output.pages_to_zero)
    sampled: dict[str, int | None] = {}
    items: list[DecodeItem | PrefillChunk] = [*output.decodes, *output.prefills]
    for item in items:
        index = world.requests.index(item.request)
        start, end, samples = _span(item)
        try:
            pool.verify(item.page_table, item.request.owner, writes_from=start // pool.page_size)
        except IsolationError as error:
            sched.fail(item.request.request_id, error)
            world.events.failed.append((index, error.reason))
            continue
        last = _run(world, index, item, start, end)
        if samples:
            sampled[item.request.request_id] = sample(last)
    sched.postprocess(output, sampled)


def _span(item: DecodeItem | PrefillChunk) -> tuple[int, int, bool]:
    if isinstance(item, DecodeItem):
        return item.position, item.position + 1, True
    return item.start, item.end, item.samples


def _run(
    world: EngineWorld, index: int, item: DecodeItem | PrefillChunk, start: int, end: int
) -> Content:
    """Write K/V for positions [start, end), then read [0, end); returns the last one read."""
    size, request = world.bound.page_size, world.requests[index]
    tokens = request.token_ids(0, end)
    for position in range(start, end):
        page_id = item.page_table[position // size].page_id
        slots = list(world.memory[page_id])
        slots[position % size] = tokens[: position + 1]
        world.memory[page_id] = tuple(slots)
    content: Content = None
    for position in range(end):
        page_id = item.page_table[position // size].page_id
        content = world.memory[page_id][position % size]
        world.events.read.append((index, position, page_id, content))
    return content
