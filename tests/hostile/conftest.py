"""Hostile-input fixtures: a real engine process and the real gateway under uvicorn on 127.0.0.1.

Both servers run with short head/body timeouts (``EDGE_TIMEOUT_S``) so slow-client tests finish in
seconds, and otherwise with their defaults (body limits included).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.testing import EngineProcess, launch_engine

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: make hostile_harness importable

from hostile_harness import (
    EDGE_TIMEOUT_S,
    ENGINE_MODEL,
    POOL_TOKENS,
    ServedGateway,
    gateway_settings,
    served_gateway,
)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: str) -> Iterator[EngineProcess]:
    proc = launch_engine(
        tiny_checkpoint,
        pool_tokens=POOL_TOKENS,
        page_size=16,
        env={
            "KVGUARD_SERVED_MODEL_NAME": ENGINE_MODEL,
            "KVGUARD_HEADER_TIMEOUT_S": str(EDGE_TIMEOUT_S),
            "KVGUARD_BODY_TIMEOUT_S": str(EDGE_TIMEOUT_S),
        },
    )
    yield proc
    proc.stop()


@pytest.fixture
def gateway(sqlite_url: str, engine: EngineProcess) -> Iterator[ServedGateway]:
    """The gateway (SQLite, in-process limiter, canary on) routing to the real engine."""
    with served_gateway(gateway_settings(sqlite_url, engine.url)) as served:
        yield served
