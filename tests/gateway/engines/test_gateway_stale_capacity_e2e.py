"""Stale capacity, end to end against the REAL bundled engine: the gateway routes only on a fresh
capacity view, refuses with 503 ``no_healthy_engine`` once that view goes stale, and routes again
when the engine answers.

The engine process is frozen with SIGSTOP: its socket still accepts connections (the kernel
queues them) but nothing answers, so the gateway's capacity poll hangs instead of failing. The
poll timeout is set far longer than the staleness bound, so for the whole window between the two
the last snapshot is merely old -- the case where a gateway that trusted its old numbers would
keep routing. SIGCONT lets the hanging poll complete and routing resumes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from gateway_harness import Gateway, bearer, running_gateway

from kvguard.testing import EngineProcess, launch_engine

pytestmark = pytest.mark.slow

# Staleness a few poll intervals long, so a busy test machine does not trip it by accident.
POLL_S, STALE_S, POLL_TIMEOUT_S = 0.3, 3.0, 60.0


@pytest.fixture
def engine(tiny_checkpoint: str) -> Iterator[EngineProcess]:
    process = launch_engine(tiny_checkpoint, pool_tokens=512, page_size=16)
    try:
        yield process
    finally:
        if process.proc.poll() is None:
            os.kill(process.proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        process.stop()


async def _until(check: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def _blocked_reason(gw: Gateway) -> str | None:
    listed = (await gw.client.get("/admin/engines", headers=gw.admin)).json()
    return listed[0]["blocked_reason"]


async def test_stale_capacity_refuses_with_503_and_recovers(engine, make_settings) -> None:
    settings = make_settings(
        engines=[{"name": "real", "base_url": engine.url}],
        poll_interval_s=POLL_S,
        capacity_stale_after_s=STALE_S,
        engine_timeout_s=POLL_TIMEOUT_S,
    )
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        model = (await gw.client.get("/v1/models", headers=bearer(key))).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0}

        async def post() -> httpx.Response:
            return await gw.client.post("/v1/completions", json=body, headers=bearer(key))

        await _until(lambda: _is_routable(gw), "the first capacity view")
        assert (await post()).status_code == 200

        os.kill(engine.proc.pid, signal.SIGSTOP)
        try:
            # The snapshot ages while the poll hangs: stale, not unreachable (no poll failed).
            reason = await _until(lambda: _blocked_reason(gw), "the capacity view to go stale")
            assert reason == "stale_capacity"
            refused = await post()
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "no_healthy_engine"
            health = await gw.client.get("/health")
        finally:
            os.kill(engine.proc.pid, signal.SIGCONT)
        assert health.status_code == 503
        assert health.json()["problems"] == ["no routable engine"]
        [listed] = health.json()["engines"]
        assert (listed["routable"], listed["blocked_reason"]) == (False, "stale_capacity")

        # The hanging poll completes once the engine runs again: fresh view, routing resumes.
        await _until(lambda: _is_routable(gw), "the engine to be routable again")
        recovered = await post()
        assert recovered.status_code == 200, recovered.text
        assert recovered.json()["usage"]["completion_tokens"] >= 1
        assert engine.proc.poll() is None  # the same process, never restarted


async def _is_routable(gw: Gateway) -> bool:
    return await _blocked_reason(gw) is None
