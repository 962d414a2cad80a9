"""Gateway test fixtures: settings on a private database, a running app, a stand-in engine."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.config import GatewaySettings

# pytest 9 imports test modules in importlib mode (sys.path untouched): make this directory's
# helper modules (gateway_harness, gateway_standin; unique names) importable from the tests.
sys.path.insert(0, str(Path(__file__).parent))

from gateway_harness import Gateway, running_gateway
from gateway_standin import StandInControls, StandInEngine, start_standin


@pytest.fixture
def make_settings(sqlite_url: str) -> Callable[..., GatewaySettings]:
    def make(**overrides: Any) -> GatewaySettings:
        values: dict[str, Any] = {
            "database_url": sqlite_url,
            "poll_interval_s": 30.0,
            "capacity_stale_after_s": 60.0,
            "audit_flush_interval_s": 0.05,
            # Generous: the stand-in engines answer in the test's own event loop, and on a loaded
            # machine that loop has stalled past 2 s (a trivial tokenize timed out, and a count
            # that should have succeeded became a 502). Tests of a timeout set their own.
            "engine_timeout_s": 10.0,
        }
        values.update(overrides)
        return GatewaySettings(**values)

    return make


@pytest.fixture
async def standin() -> AsyncIterator[StandInEngine]:
    engine = await start_standin(StandInControls())
    yield engine
    await engine.stop()


@pytest.fixture
async def gateway(
    make_settings: Callable[..., GatewaySettings], standin: StandInEngine
) -> AsyncIterator[Gateway]:
    """A gateway app (in-process transport) routing to the stand-in engine."""
    settings = make_settings(
        engines=[{"name": "standin", "kind": "bundled", "base_url": standin.url}]
    )
    async with running_gateway(settings) as gw:
        yield gw
