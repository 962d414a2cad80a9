"""Periodic wake-ups on one grid per process, so that its background loops wake together.

A process's background loops (the audit flush, the key renewal, the lease refresh, the capacity
poll, the engine reload, the spool's drain, the server's tick) each slept their period from where
their last round ended, every loop on a phase of its own: an idle gateway was woken about five
times a second, and on this project's machines a wake of an idle event loop costs about 190 µs of
CPU (``docs/benchmarks.md``, steps 16 and 17): at a few requests a second, every request pays for
them. A loop that sleeps with ``sleep(period_s)`` instead wakes at the next point of the grid
``PHASE + k * period_s`` (the loop's clock) at least a quarter period away:

- loops whose periods are multiples of one another (0.5 s, 1 s, 5 s) wake at the same moments:
  a point is a loop time rounded to the millisecond, and the loop's timers for one loop time are
  due together (uvloop's timers count whole milliseconds; asyncio's run every timer that is due),
  so they run in one turn (on uvloop nearly always: its ``call_at(when)`` is
  ``call_later(when - time())``, rounded to whole milliseconds and started from libuv's clock read
  once more, so a timer set just as that clock ticks is due a millisecond late; the foundation
  test's three loops saw one of about 28 points split over two turns that way in some runs, so
  that test runs on asyncio's loop, whose timers keep their ``when``). ``asyncio.sleep(delay)``
  would not do: it adds the delay to the time at which it is called, so loops that started apart
  stay apart, a wake each;
- a loop's rounds still come one period apart (a round shorter than three quarters of its period
  ends before the next point), and no wait is longer than one and a quarter periods;
- ``PHASE`` is drawn once per process, so the replicas on one host do not all wake at once.

``deadline(period_s)``: the same point, as the loop time for ``asyncio.timeout_at`` (a loop that
waits for an event *or* its period).
"""

from __future__ import annotations

import asyncio
import math
import random

PHASE = (
    random.randrange(1000) / 1000
)  # s, whole ms: the grid's offset in this process (not a secret)


def next_point(period_s: float, now: float) -> float:
    """The first point of ``period_s``'s grid at least a quarter period after ``now``."""
    if not period_s > 0:
        raise ValueError(f"a period must be positive (got {period_s!r})")
    at = PHASE + (math.floor((now - PHASE) / period_s) + 1) * period_s
    if at - now < period_s / 4:
        at += period_s
    return round(at, 3)


def deadline(period_s: float) -> float:
    """``next_point`` on the running loop's clock (for ``asyncio.timeout_at``)."""
    return next_point(period_s, asyncio.get_running_loop().time())


async def sleep(period_s: float) -> None:
    """Sleep until the next point of ``period_s``'s grid (see the module docstring)."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()
    timer = loop.call_at(next_point(period_s, loop.time()), _wake, woken)
    try:
        await woken
    finally:
        timer.cancel()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
