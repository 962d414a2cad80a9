"""`kvguard gateway` builds the canary from KVGUARD_CANARY_*; `kvguard canary` commands."""

from __future__ import annotations

import pytest
import uvicorn

from kvguard.cli import main


@pytest.fixture
def served(monkeypatch) -> list:
    """The app `kvguard gateway` would serve (uvicorn's run loop is not started)."""
    apps: list = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: apps.append(self.config.app))
    return apps


def _paths(app) -> set[str]:
    return set(app.openapi()["paths"])


def test_the_gateway_command_mounts_the_canary(served, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    assert main(["gateway", "--port", "0"]) == 0
    assert {"/admin/canary/findings", "/v1/canary/findings"} <= _paths(served[0])
    monkeypatch.setenv("KVGUARD_CANARY_ENABLED", "false")
    assert main(["gateway", "--port", "0"]) == 0
    assert "/admin/canary/findings" not in _paths(served[1])


def test_the_gateway_refuses_a_default_canary_key_in_production(
    served, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("KVGUARD_MODE", "production")
    monkeypatch.setenv("KVGUARD_ADMIN_TOKEN", "Zq3-admin-token-7Hx0pLw9-vK2mR5tN8s")
    monkeypatch.setenv("KVGUARD_METRICS_TOKEN", "Yb6-scrape-token-4Jd1qAe8-uT3nC7wF2k")
    monkeypatch.setenv("KVGUARD_ENGINE_TOKEN", "Eg4-engine-token-8Rw2pQz5-Lm7kT3vN6x")
    monkeypatch.setenv("KVGUARD_REDIS_URL", "redis://127.0.0.1:1")
    assert main(["gateway", "--port", "0"]) == 2  # one line, exit 2: not a traceback
    assert "KVGUARD_CANARY_KEY must be set" in capsys.readouterr().err
    assert served == []


def test_new_key_and_probe_usage_errors(capsys, monkeypatch) -> None:
    assert main(["canary", "new-key"]) == 0
    key = capsys.readouterr().out.strip()
    assert len(key) == 64
    monkeypatch.delenv("KVGUARD_CANARY_GATEWAY_URL", raising=False)
    assert main(["canary", "probe", "--once"]) == 2
    assert "--gateway" in capsys.readouterr().err
    # Nothing listening there: the probes cannot run at all (exit 2, not a probe failure).
    assert main(["canary", "probe", "--once", "--gateway", "http://127.0.0.1:9"]) == 2
