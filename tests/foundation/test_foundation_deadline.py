"""``contracts.deadline.running_timeout``: a timeout that counts the time this event loop ran, so
a stall of the process itself (a full garbage collection, a CPU taken away) is not blamed on the
peer, while a peer that never answers still times out."""

from __future__ import annotations

import asyncio
import time

import pytest

from contracts.deadline import TICKS, running_timeout

STALL_S = 0.5


def stall_this_loop(seconds: float) -> None:
    """The loop stands still as in a garbage collection: no callback runs, no I/O is read."""
    asyncio.get_running_loop().call_soon(time.sleep, seconds)


async def test_a_stall_of_this_loop_is_not_counted_against_the_wait() -> None:
    stall_this_loop(STALL_S)
    async with running_timeout(0.3):
        await asyncio.sleep(0.05)  # due during the stall, done on waking


async def test_the_same_stall_fails_a_wall_clock_timeout() -> None:
    """The control: what the stall does to ``asyncio.timeout`` (why ``running_timeout`` exists)."""
    stall_this_loop(STALL_S)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await asyncio.sleep(0.05)


async def test_a_wait_that_never_ends_times_out_after_its_budget() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with running_timeout(0.2):
            await loop.create_future()
    assert 0.2 <= loop.time() - started < 3.0


async def test_a_stall_counts_as_one_tick_and_never_ends_the_wait_itself() -> None:
    """A stall near the end of the budget: the wait still gets a tick of running loop after it,
    and a wait that never ends still fails, one tick later than without the stall."""
    loop = asyncio.get_running_loop()
    budget = 0.2
    loop.call_later(budget * 0.8, time.sleep, STALL_S)  # the loop stands still near the end
    waiter = loop.create_future()
    loop.call_later(budget * 0.8 + 0.01, waiter.set_result, "done")  # answered just after it
    async with running_timeout(budget):
        assert await waiter == "done"

    started = loop.time()
    loop.call_later(budget * 0.5, time.sleep, STALL_S)
    with pytest.raises(TimeoutError):
        async with running_timeout(budget):
            await loop.create_future()
    waited = loop.time() - started
    assert budget + STALL_S <= waited < budget + STALL_S + budget / TICKS + 3.0


async def test_a_budget_of_zero_expires_at_once() -> None:
    with pytest.raises(TimeoutError):
        async with running_timeout(0):
            await asyncio.sleep(1)


async def test_leaving_early_stops_the_watch() -> None:
    loop = asyncio.get_running_loop()

    def timers() -> int:
        return sum(not handle.cancelled() for handle in loop._scheduled)  # type: ignore[attr-defined]

    before = timers()
    async with running_timeout(5):
        await asyncio.sleep(0)
        assert timers() == before + 1  # the watch's tick
    assert timers() == before
