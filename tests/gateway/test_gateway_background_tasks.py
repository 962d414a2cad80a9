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
    async def purge_that_fails(*_: object, **__: object) -> None:
        raise RuntimeError("an error its loop did not catch")

    monkeypatch.setattr(gateway_app.stored_responses, "purge_loop", purge_that_fails)
    async with running_gateway(make_settings()) as gw:
        for _ in range(200):  # 10 s at most: the task's end is seen once the loop runs again
            if gw.state.ended_tasks:
                break
            await asyncio.sleep(0.05)
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
