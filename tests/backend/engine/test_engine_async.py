"""The engine thread's hand-over to the event loop: one wake-up per engine step for all of its
requests (the loop is woken once per step with every request's event of that step, in order),
and every request still gets each of its tokens and exactly one terminal event -- also when the
loop itself fails (then the engine serves nothing more, and says so)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from backend.config import BackendSettings
from backend.core.request import SamplingParams
from backend.engine.async_engine import EngineFailed
from backend.engine.build import build_engine


class _CountingLoop:
    """The running loop, counting how often another thread wakes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.wakeups = 0

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> Any:
        self.wakeups += 1
        return self._loop.call_soon_threadsafe(callback, *args)


async def test_one_wakeup_per_step_for_every_request(tiny_checkpoint: str) -> None:
    settings = BackendSettings(
        model=tiny_checkpoint, pool_tokens=512, page_size=16, max_running=8, prefix_cache=False
    )
    built = build_engine(settings)
    engine = built.engine
    steps = 0

    def count(outcome: Any) -> None:
        nonlocal steps
        steps += 1

    engine._on_step = count
    engine.start()
    counting = _CountingLoop(asyncio.get_running_loop())
    engine._loop = counting  # type: ignore[assignment]
    try:
        requests, tokens = 6, 8
        generations = [
            engine.submit(
                request_id=f"r{i}",
                tenant="t",
                prompt_ids=[256, 97 + i, 98, 99],
                sampling=SamplingParams(max_tokens=tokens, temperature=0.0),
            )
            for i in range(requests)
        ]

        async def drain(generation: Any) -> list[Any]:
            return [event async for event in generation.events()]

        streams = await asyncio.wait_for(asyncio.gather(*map(drain, generations)), 60)
    finally:
        await engine.stop()
    assert all(1 <= sum(e.token is not None for e in s) <= tokens for s in streams)
    assert all([e.is_terminal for e in s].count(True) == 1 and s[-1].is_terminal for s in streams)
    # every step's events for all its requests arrive in one wake-up: one per request per step
    # would be one wake-up per event
    events = sum(len(s) for s in streams)
    assert 0 < counting.wakeups <= steps
    assert events >= 3 * counting.wakeups


class _FailingOnce:
    """The scheduler, whose next ``schedule`` raises what no step catches (as a CUDA or
    out-of-memory error in a forward pass, staging or zeroing does)."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self.failed = False

    def schedule(self) -> Any:
        if not self.failed:
            self.failed = True
            raise RuntimeError("CUDA error: out of memory")
        return self._scheduler.schedule()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


async def test_a_failed_engine_loop_ends_every_request_and_refuses_new_ones(
    tiny_checkpoint: str,
) -> None:
    """The loop's thread died on such an error and nothing said so: queued requests never ended
    (each waited for the server's timeout), new ones were queued for nobody, and health and
    capacity stayed as they were, so the gateway kept routing here."""
    settings = BackendSettings(model=tiny_checkpoint, pool_tokens=512, page_size=16)
    engine = build_engine(settings).engine
    failing = _FailingOnce(engine.core.scheduler)
    engine.core.scheduler = failing
    engine.start()
    try:
        generations = [
            engine.submit(
                request_id=f"r{i}",
                tenant="t",
                prompt_ids=[256, 97, 98, 99],
                sampling=SamplingParams(max_tokens=4, temperature=0.0),
            )
            for i in range(3)
        ]

        async def drain(generation: Any) -> list[Any]:
            return [event async for event in generation.events()]

        streams = await asyncio.wait_for(asyncio.gather(*map(drain, generations)), 30)
        assert failing.failed and engine.failed is not None
        for stream in streams:
            [ended] = stream
            assert ended.is_terminal and ended.error is not None
            assert ended.error.code == "engine_failed" and ended.error.http_status == 503
        with pytest.raises(EngineFailed, match="RuntimeError"):
            engine.submit(
                request_id="late",
                tenant="t",
                prompt_ids=[256, 97],
                sampling=SamplingParams(max_tokens=1, temperature=0.0),
            )
    finally:
        await engine.stop()
