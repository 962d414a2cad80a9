"""``contracts.grid``: a process's periodic loops wake on one grid, together.

The points: on the grid of each period, never nearer than a quarter period nor further than one
and a quarter, one period apart from one another. On an event loop: three loops of periods 0.1,
0.2 and 0.4 s, started apart, wake only in the turns of the loop in which the 0.1 s loop wakes --
one wake of the process per 0.1 s, not one per loop. The same three loops on ``asyncio.sleep``
(the control) wake in turns of their own. What it saves a gateway on uvloop is measured by
``bench.relay_slope`` (its idle column) and recorded in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import pytest

from contracts import grid

PERIODS = (0.1, 0.2, 0.4)
STARTS = (0.0, 0.013, 0.037)  # s: the loops start apart, as a server's loops do
ROUNDS = 4  # of the longest period


@pytest.mark.parametrize("period", [0.05, 0.5, 1.0, 5.0, 600.0])
@pytest.mark.parametrize("now", [0.0, 0.3, 1234.5678, 98765.4321])
def test_a_point_is_on_the_grid_a_quarter_to_one_and_a_quarter_periods_away(
    period: float, now: float
) -> None:
    at = grid.next_point(period, now)
    steps = (at - grid.PHASE) / period
    assert math.isclose(steps, round(steps), abs_tol=1e-6)
    assert period / 4 - 0.001 <= at - now <= 1.25 * period + 0.001
    # the next round, started at that point, wakes one period later
    assert math.isclose(grid.next_point(period, at), at + period, abs_tol=0.001)


def test_the_points_of_a_period_are_points_of_its_divisors() -> None:
    for now in (0.0, 17.3, 4242.42):
        at = grid.next_point(1.0, now)
        assert grid.next_point(0.5, at - 0.2) == at
        assert grid.next_point(0.1, at - 0.05) == at


def test_a_period_that_is_not_positive_is_refused() -> None:
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="positive"):
            grid.next_point(bad, 10.0)


class Turns:
    """Which turn of the event loop a wake ran in: the first wake of a turn opens a mark that a
    callback of the next turn closes (callbacks scheduled during a turn run in the next one)."""

    def __init__(self) -> None:
        self.current: object | None = None

    def mark(self) -> object:
        if self.current is None:
            self.current = object()
            asyncio.get_running_loop().call_soon(self._close)
        return self.current

    def _close(self) -> None:
        self.current = None


async def _wakes(sleep: Callable[[float], Awaitable[None]]) -> dict[float, list[object]]:
    """The turns in which each loop woke: the slower loops ``ROUNDS`` of the longest period, the
    fastest until they are done."""
    turns, found = Turns(), {period: [] for period in PERIODS}
    longest = max(PERIODS)

    async def loop(period: float, start: float, rounds: float) -> None:
        await asyncio.sleep(start)
        done = 0
        while done < rounds:
            await sleep(period)
            found[period].append(turns.mark())
            done += 1

    fastest, *slower = zip(PERIODS, STARTS, strict=True)
    running = asyncio.create_task(loop(*fastest, math.inf))
    await asyncio.gather(*(loop(*each, round(ROUNDS * longest / each[0])) for each in slower))
    running.cancel()
    return found


def test_loops_of_periods_that_divide_each_other_wake_in_the_same_turns() -> None:
    found = asyncio.run(_wakes(grid.sleep))
    fastest = found[min(PERIODS)]
    assert len(set(fastest)) == len(fastest)  # one wake a turn
    for period in PERIODS:
        assert set(found[period]) <= set(fastest), period


def test_the_control_loops_on_asyncio_sleep_wake_in_turns_of_their_own() -> None:
    """Without the grid, the same loops wake in turns the fastest loop does not wake in: the
    wakes the grid saves."""
    found = asyncio.run(_wakes(asyncio.sleep))
    fastest = set(found[min(PERIODS)])
    others = {turn for period in PERIODS[1:] for turn in found[period]}
    assert others - fastest
