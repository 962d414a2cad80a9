"""Breadth-first exploration with state hashing, counterexample traces and a liveness check.

Safety: every invariant asked for is judged on every reachable state (and the move into it); the
first violation ends the search with the shortest trace (BFS). Liveness under fairness: from every
reachable state a ``done`` state (every request terminal, nothing in flight, every page free) must
stay reachable. On a finite graph, with every enabled move eventually taken, that is exactly
"every request ends and every quarantined page is freed"; a state from which ``done`` is
unreachable is printed as a trace to it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from backend.disagg.faults import FaultSet
from backend.verify import actions, engine_checks, engine_world
from backend.verify.engine_world import EngineBound, EngineEvents, EngineWorld
from backend.verify.invariants import ALL_INVARIANTS, Invariant, first_violation
from backend.verify.render import render_world
from backend.verify.world import Bound, Events, World

LIVENESS = "liveness"
INCOMPLETE = "incomplete"  # the state limit stopped the search: nothing was proved
_NO_FAULTS = FaultSet()


@dataclass(frozen=True, slots=True)
class Model:
    """What the search needs from a model: its worlds (which have ``key`` and ``done``), their
    moves, their invariants, a way to forget the last move's events, and a picture."""

    initial: Callable[[Any, FaultSet], Any]
    successors: Callable[[Any], Iterator[tuple[str, Any]]]
    violation: Callable[[Any, frozenset[Invariant]], tuple[Invariant, str] | None]
    settle: Callable[[Any], None]
    render: Callable[[Any], str]


def _settle_handoff(world: World) -> None:
    world.events = Events()


def _settle_engine(world: EngineWorld) -> None:
    world.events = EngineEvents()


# The prefill -> decode handoff (world, actions, invariants 1-6) and one engine with shared and
# preempted pages (engine_world, engine_checks, invariants 7-10).
HANDOFF = Model(World.initial, actions.successors, first_violation, _settle_handoff, render_world)
ENGINE = Model(
    EngineWorld.initial,
    engine_world.successors,
    engine_checks.first_violation,
    _settle_engine,
    engine_checks.render,
)


@dataclass(frozen=True, slots=True)
class Step:
    label: str
    picture: str


@dataclass(frozen=True, slots=True)
class Report:
    bound: str
    faults: tuple[str, ...]
    states: int
    transitions: int
    seconds: float
    violated: str | None  # an Invariant value, LIVENESS, or None
    problem: str
    trace: tuple[Step, ...]

    @property
    def passed(self) -> bool:
        return self.violated is None


def check(
    bound: Bound | EngineBound,
    faults: FaultSet = _NO_FAULTS,
    *,
    invariants: frozenset[Invariant] = ALL_INVARIANTS,
    liveness: bool = True,
    max_states: int = 2_000_000,
) -> Report:
    started = time.perf_counter()
    model = ENGINE if isinstance(bound, EngineBound) else HANDOFF
    root = model.initial(bound, faults)
    index: dict[tuple[object, ...], int] = {root.key(): 0}
    worlds: list[Any] = [root]
    parent: list[tuple[int, str]] = [(-1, "initial state")]
    edges: list[list[int]] = [[]]
    finished: list[bool] = [root.done()]
    frontier = deque([0])
    transitions = 0

    def report(violated: str | None, problem: str, at: int | None) -> Report:
        trace = _trace(model, at, parent, bound, faults) if at is not None else ()
        return Report(
            bound.name,
            tuple(faults.names),
            len(parent),
            transitions,
            time.perf_counter() - started,
            violated,
            problem,
            trace,
        )

    while frontier:
        here = frontier.popleft()
        world = worlds[here]
        assert world is not None
        for label, nxt in model.successors(world):
            transitions += 1
            found = model.violation(nxt, invariants)
            model.settle(nxt)
            key = nxt.key()
            there = index.get(key)
            if there is None:
                there = len(parent)
                index[key] = there
                worlds.append(nxt)
                parent.append((here, label))
                edges.append([])
                finished.append(nxt.done())
                frontier.append(there)
            if found is not None:
                if index[key] != there or parent[there][0] != here:  # reached before, other way
                    worlds.append(nxt)
                    parent.append((here, label))
                    edges.append([])
                    finished.append(nxt.done())
                    there = len(parent) - 1
                return report(found[0].value, found[1], there)
            edges[here].append(there)
            if len(parent) > max_states:
                return report(INCOMPLETE, f"more than {max_states} states: bound too large", None)
        worlds[here] = None  # expanded: traces replay from the initial state by label
    if liveness:
        stuck = _stuck(finished, edges)
        if stuck is not None:
            return report(
                LIVENESS, "from here no run ends every request and frees every page", stuck
            )
    return report(None, "", None)


def _stuck(finished: list[bool], edges: list[list[int]]) -> int | None:
    """The first state (BFS order) from which no ``done`` state is reachable, if any."""
    reverse: list[list[int]] = [[] for _ in edges]
    for source, targets in enumerate(edges):
        for target in targets:
            reverse[target].append(source)
    good = [False] * len(edges)
    queue = deque(i for i, done in enumerate(finished) if done)
    for i in queue:
        good[i] = True
    while queue:
        for source in reverse[queue.popleft()]:
            if not good[source]:
                good[source] = True
                queue.append(source)
    return next((i for i, ok in enumerate(good) if not ok), None)


def _trace(
    model: Model,
    at: int,
    parent: list[tuple[int, str]],
    bound: Bound | EngineBound,
    faults: FaultSet,
) -> tuple[Step, ...]:
    """Replay the path to ``at`` from the initial state, rendering each world on the way."""
    labels: list[str] = []
    node = at
    while node > 0:
        node, label = parent[node]
        labels.append(label)
    labels.reverse()
    world = model.initial(bound, faults)
    steps = [Step("initial state", model.render(world))]
    for label in labels:
        world = next(w for lab, w in model.successors(world) if lab == label)
        steps.append(Step(label, model.render(world)))
        model.settle(world)
    return tuple(steps)
