"""Canary test fixtures: canary settings with a fixed test key, a gateway served over real HTTP."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

# Test modules are imported in importlib mode (sys.path untouched): make this directory's helper
# module (canary_harness; a unique name) importable from the tests.
sys.path.insert(0, str(Path(__file__).parent))

from canary_harness import TEST_CANARY_KEY, Provider, start_provider

from canary.config import CanarySettings
from gateway.config import GatewaySettings


@pytest.fixture
def canary_settings() -> Callable[..., CanarySettings]:
    def make(**overrides: Any) -> CanarySettings:
        values: dict[str, Any] = {"canary_key": TEST_CANARY_KEY, "canary_tag_refresh_s": 30.0}
        values.update(overrides)
        return CanarySettings(**values)

    return make


@pytest.fixture
def gateway_settings(sqlite_url: str) -> Callable[..., GatewaySettings]:
    def make(**overrides: Any) -> GatewaySettings:
        values: dict[str, Any] = {
            "database_url": sqlite_url,
            "poll_interval_s": 30.0,
            "capacity_stale_after_s": 60.0,
            "audit_flush_interval_s": 0.05,
            "engine_timeout_s": 5.0,
        }
        values.update(overrides)
        return GatewaySettings(**values)

    return make


@pytest.fixture
async def provider() -> AsyncIterator[Provider]:
    """The named stand-in for a third-party OpenAI-compatible engine (canary_harness), on a
    real HTTP port."""
    p = await start_provider()
    yield p
    await p.stop()
