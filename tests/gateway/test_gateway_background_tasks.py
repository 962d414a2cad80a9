"""A gateway background task that ends by itself (a failure its loop did not catch: the capacity
poller, the audit writer, the quarantine writer, the key renewal, the purge) is a health problem
naming it, and a critical log line: before, such an end was silent, and the gateway answered
"ok" while, say, its audit rows or quarantine decisions waited on disk for a restart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from gateway_harness import running_gateway

from gateway import app as gateway_app
from gateway.config import GatewaySettings


async def test_a_background_task_that_ends_is_a_health_problem(
    make_settings: Callable[..., GatewaySettings],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fail = asyncio.Event()

    async def purge_that_fails(*_: object, **__: object) -> None:
        await fail.wait()
        raise RuntimeError("an error its loop did not catch")

    monkeypatch.setattr(gateway_app.stored_responses, "purge_loop", purge_that_fails)
    async with running_gateway(make_settings()) as gw:
        # the gateway runs in this event loop: its purge task is one of this loop's tasks
        [purge] = [t for t in asyncio.all_tasks() if t.get_name() == "responses-purge"]
        assert gw.state.ended_tasks == {}
        fail.set()
        await asyncio.wait([purge], timeout=10)  # the done-callbacks ran before this returns
        assert gw.state.ended_tasks == {"responses-purge": "RuntimeError"}
        health = await gw.client.get("/health")
        assert health.status_code == 503
        problems = health.json()["problems"]
        assert "background task responses-purge ended (RuntimeError)" in problems
        assert "did not catch" not in health.text  # the error's text is the log's only
    assert any(
        r.levelno == logging.CRITICAL and "responses-purge" in r.getMessage() and r.exc_info
        for r in caplog.records
    )
