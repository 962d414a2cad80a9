"""A timeout that measures the peer, not this process standing still.

``asyncio.timeout(s)`` counts wall time. When this process's event loop stands still past the
deadline -- a full garbage collection of a large heap, a CPU taken by other processes -- the
deadline's timer runs first on waking, before the connection that completed meanwhile can finish
its remaining steps on the loop (a TCP connect needs several), so the wait fails with the peer
blameless: a Redis limiter that answered at once reads as "did not accept a connection in time",
and the gateway refuses requests while every service is healthy.

``running_timeout(s)`` counts only the time the loop was running: a watch ticks every tenth of
the budget, and a gap between ticks counts at most one tick. It expires only on a tick that came
on time, so after any stall the awaited work has at least a tick of running loop to finish in. A
peer that never answers still fails after ``s`` (a little more, by the ticks' lateness), and a
stall adds at most one tick to the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

TICKS = 10  # ticks per budget: the most a stall is counted as is budget / TICKS
LATE = 2.0  # a gap past this many ticks is the loop standing still


@contextlib.asynccontextmanager
async def running_timeout(seconds: float) -> AsyncIterator[None]:
    """Like ``asyncio.timeout(seconds)`` (``TimeoutError`` on expiry), counting only the time this
    event loop was running."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(None) as timeout:
        watch = _Watch(loop, timeout, seconds)
        try:
            yield
        finally:
            watch.stop()


class _Watch:
    __slots__ = ("_loop", "_timeout", "_budget", "_step", "_used", "_last", "_handle")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, timeout: asyncio.Timeout, seconds: float
    ) -> None:
        self._loop = loop
        self._timeout = timeout
        self._budget = seconds
        self._step = seconds / TICKS
        self._used = 0.0
        self._last = loop.time()
        self._handle: asyncio.TimerHandle | None = None
        if seconds > 0:
            self._handle = loop.call_at(self._last + self._step, self._tick)
        else:
            timeout.reschedule(self._last)

    def _tick(self) -> None:
        now = self._loop.time()
        gap, self._last = now - self._last, now
        self._used += min(gap, self._step)
        if self._used >= self._budget and gap <= LATE * self._step:
            self._handle = None
            self._timeout.reschedule(now)  # expires now: asyncio cancels the wait, TimeoutError
        else:
            self._handle = self._loop.call_at(now + self._step, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
