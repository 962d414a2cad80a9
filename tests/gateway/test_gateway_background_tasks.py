"""A gateway background task that ends by itself (a failure its loop did not catch: the capacity
poller, the audit writer, the quarantine writer, the key renewal, the purge, the limiter's
refresh, a hook service's tasks) is a health problem
naming it, and a critical log line: before, such an end was silent, and the gateway answered
"ok" while, say, its audit rows or quarantine decisions waited on disk for a restart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from gateway_harness import running_gateway
from sqlalchemy import Engine

from canary.config import CanarySettings
from canary.keeper import FindingKeeper
from canary.runtime import CanaryRuntime
from gateway import app as gateway_app
from gateway.config import GatewaySettings
from gateway.limits.redis_limiter import RedisLimiter

CANARY_KEY = "background-task-canary-key-0123456789abcdef"


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
        stopped = spy_on_the_last_step_of_stopping(gw.state.db)
        # the gateway runs in this event loop: its purge task is one of this loop's tasks
        [purge] = [t for t in asyncio.all_tasks() if t.get_name() == "responses-purge"]
        assert gw.state.ended_tasks == {}
        fail.set()
        await asyncio.wait([purge], timeout=10)  # the done-callbacks ran before this returns
        assert gw.state.ended_tasks == {"responses-purge": "RuntimeError"}
        health = await gw.client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed"  # for good: kvguard up ends on it
        problems = health.json()["problems"]
        assert "background task responses-purge ended (RuntimeError)" in problems
        assert "did not catch" not in health.text  # the error's text is the log's only
    assert any(
        r.levelno == logging.CRITICAL and "responses-purge" in r.getMessage() and r.exc_info
        for r in caplog.records
    )
    assert stopped, "the gateway's stop ended at the failed task, before its last step"


def spy_on_the_last_step_of_stopping(engine: Engine) -> list[bool]:
    """A list that holds True once the gateway's stop reached its last step (its database engine
    disposed), after the audit writer, the quarantines, the limiter and the clients closed."""
    reached: list[bool] = []
    dispose = engine.dispose

    def spied(*args: object, **kwargs: object) -> None:
        reached.append(True)
        dispose(*args, **kwargs)  # type: ignore[arg-type]

    engine.dispose = spied  # type: ignore[method-assign]
    return reached


async def test_the_limiters_and_the_canarys_background_tasks_are_watched_too(
    make_settings: Callable[..., GatewaySettings],
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tasks the limiter and a hook service start (the lease and credit refresh, the canary's
    findings writer and tag refresh) are watched like the gateway's own, and their stops still
    let the gateway's run to its end."""
    fail = asyncio.Event()

    async def loop_that_fails(*_: object, **__: object) -> None:
        await fail.wait()
        raise RuntimeError("an error its loop did not catch")

    monkeypatch.setattr(RedisLimiter, "_refresh_loop", loop_that_fails)
    monkeypatch.setattr(FindingKeeper, "run", loop_that_fails)
    monkeypatch.setattr(CanaryRuntime, "_refresh_loop", loop_that_fails)
    hooks = CanaryRuntime(CanarySettings(canary_key=CANARY_KEY)).hooks()
    names = {"lease-refresh", "canary-findings", "canary-tag-refresh"}
    async with running_gateway(make_settings(redis_url=redis_url), hooks=hooks) as gw:
        stopped = spy_on_the_last_step_of_stopping(gw.state.db)
        tasks = [t for t in asyncio.all_tasks() if t.get_name() in names]
        assert {t.get_name() for t in tasks} == names
        fail.set()
        await asyncio.wait(tasks, timeout=10)  # the done-callbacks ran before this returns
        assert gw.state.ended_tasks == dict.fromkeys(names, "RuntimeError")
        health = await gw.client.get("/health")
        assert health.status_code == 503
        assert "background task lease-refresh ended (RuntimeError)" in health.json()["problems"]
    assert stopped, "the canary's or the limiter's stop ended at the failed task"
