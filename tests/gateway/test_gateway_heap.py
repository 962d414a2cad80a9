"""The process `kvguard gateway` serves settles its heap once started (``contracts.heap``): what
start-up built is frozen, so a full collection no longer walks it (the pauses that were 45-70 ms
under load); an app built without ``settle`` (a test's) freezes nothing."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewaySettings
from kvguard.cli import main


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # what a test froze is collected as before


def test_the_served_gateway_freezes_its_start_up_heap(unfrozen, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    served: list = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: served.append(self.config.app))
    assert main(["gateway", "--port", "0"]) == 0
    assert gc.get_freeze_count() == 0  # built, not started
    with TestClient(served[0]):
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the modules and models start-up made, at least
        started_state = served[0].state.gateway
        assert gc.is_tracked(started_state)
        # the state built in the lifespan is among what froze: a full collection skips it
        assert not any(obj is started_state for obj in gc.get_objects(generation=2))


def test_an_app_built_without_settle_freezes_nothing(unfrozen, tmp_path) -> None:
    settings = GatewaySettings(data_dir=tmp_path)
    with TestClient(create_app(settings)) as client:
        assert client.app.state.gateway is not None  # started
        assert gc.get_freeze_count() == 0
