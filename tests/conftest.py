"""Shared fixtures: private Redis and PostgreSQL servers for this test session.

Each pytest session starts its own servers from the installed binaries on free ports in temp dirs
(kvguard.localservices), so parallel sessions never collide and nothing depends on a server left
running by hand. Tests get isolation per test: a fresh PostgreSQL database, a flushed Redis db.
"""

from __future__ import annotations

import gc
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.localservices import RunningService, postgres_server, redis_server
from kvguard.testing import EngineProcess, launch_engine, write_tiny_checkpoint

# litellm must never reach the network from a test process, wherever it gets imported.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# OpenAI's published schemas and their validator (tests/openapi), for every test directory.
sys.path.insert(0, str(Path(__file__).parent / "openapi"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left alive (torch, transformers, litellm and every test module: about
    650,000 objects) so that no full garbage collection walks it again. Those collections stopped
    this process's event loops for 0.30-0.38 s each, a stall that every test with a timeout
    shares (measured over tests/backend/verify, tests/backend/bundled and tests/canary: the
    longest pause during a test fell from 353 to under 134 ms, their sum from 7.9 to 2.6 s).
    Objects freed by reference counting are still freed; only cycles made before this point are
    kept for the session."""
    gc.collect()
    gc.freeze()


_module_frozen = [""]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Freeze again at each test module's first test, before its fixtures: what earlier modules
    left alive (litellm's lazily loaded parts, caches, session servers' clients) stops being walked
    by every later full collection. Without it the full collections of the gateway tier grew to
    0.45-0.75 s (717,000 objects after the litellm tests), past the 0.5 s a Redis connect is given,
    and timed-bound tests failed on stalls of the test process itself. The collection here frees
    what the previous module's fixtures left in cycles."""
    module = item.nodeid.partition("::")[0]
    if module != _module_frozen[0]:
        _module_frozen[0] = module
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def redis_service() -> Iterator[RunningService]:
    with redis_server() as service:
        yield service


@pytest.fixture(scope="session")
def postgres_service() -> Iterator[RunningService]:
    with postgres_server() as service:
        yield service


@pytest.fixture
def redis_url(redis_service: RunningService) -> Iterator[str]:
    """A Redis URL on this session's private server, emptied before the test."""
    import redis

    client = redis.Redis.from_url(redis_service.url)
    client.flushdb()
    client.close()
    yield redis_service.url


@pytest.fixture
def postgres_url(postgres_service: RunningService) -> Iterator[str]:
    """A SQLAlchemy URL of a brand-new database, dropped after the test."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    dsn = {"host": postgres_service.host, "port": postgres_service.port, "user": "postgres"}
    with psycopg.connect(**dsn, dbname="postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://postgres@{postgres_service.host}:{postgres_service.port}/{name}"
    with psycopg.connect(**dsn, dbname="postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: pytest.TempPathFactory) -> str:
    """The embedded default: a SQLite file in the test's temp dir."""
    return f"sqlite:///{tmp_path}/kvguard.db"


# -- the real engine, as a process ----------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engine_factory(tiny_checkpoint: str) -> Iterator[object]:
    """Start real engine processes: ``engine_factory(pool_tokens=..., context_window=...)``.

    Returns the base URL; ``model`` defaults to the tiny test checkpoint. Every engine started is
    stopped after the test.
    """
    started: list[EngineProcess] = []

    def start(role: str = "unified", env: dict[str, str] | None = None, **options: object) -> str:
        model = str(options.pop("model", tiny_checkpoint))
        engine = launch_engine(model, role, env, **options)
        started.append(engine)
        return engine.url

    yield start
    for engine in started:
        engine.stop()
