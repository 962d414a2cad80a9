"""Gateway settings: defaults, refused default secrets, production needs Redis, engines."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from contracts.settings import DEV_ADMIN_TOKEN
from gateway.config import GatewaySettings
from gateway.engines.spec import EngineKind, EngineSpec, parse_engine_arg

ADMIN = "Zq3-admin-token-7Hx0pLw9-vK2mR5tN8s"  # strong enough for production
SCRAPE = "Yb6-scrape-token-4Jd1qAe8-uT3nC7wF2k"
ENGINE = "Eg4-engine-token-8Rw2pQz5-Lm7kT3vN6x"


def test_development_defaults(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = GatewaySettings()
    assert settings.admin_secret() == DEV_ADMIN_TOKEN
    assert settings.sqlalchemy_url() == f"sqlite:///{tmp_path}/data/kvguard.db"
    assert settings.redis_url is None


def test_production_refuses_default_secrets_and_missing_redis() -> None:
    with pytest.raises(ValidationError, match="KVGUARD_ADMIN_TOKEN"):
        GatewaySettings(mode="production", redis_url="redis://x")
    with pytest.raises(ValidationError, match="KVGUARD_ADMIN_TOKEN"):
        GatewaySettings(mode="production", admin_token=DEV_ADMIN_TOKEN, redis_url="redis://x")
    with pytest.raises(ValidationError, match="KVGUARD_REDIS_URL"):
        GatewaySettings(
            mode="production", admin_token=ADMIN, metrics_token=SCRAPE, engine_token=ENGINE
        )
    real = {"admin_token": ADMIN, "redis_url": "redis://x"}
    with pytest.raises(ValidationError, match="KVGUARD_METRICS_TOKEN"):
        GatewaySettings(mode="production", **real)  # /metrics carries every tenant's series
    with pytest.raises(ValidationError, match="KVGUARD_ENGINE_TOKEN"):
        GatewaySettings(mode="production", metrics_token=SCRAPE, **real)  # engines' credential
    ok = GatewaySettings(mode="production", metrics_token=SCRAPE, engine_token=ENGINE, **real)
    assert ok.admin_secret() == ADMIN
    assert ok.metrics_secret() == SCRAPE
    assert GatewaySettings().metrics_secret() is None  # development: /metrics open unless set


def test_unknown_setting_is_refused() -> None:
    # (Unknown KVGUARD_* environment variables cannot be refused: other deployables share the
    # prefix. Fields given in code, an engines file or an engine spec are checked.)
    with pytest.raises(ValidationError, match="admin_tokne"):
        GatewaySettings(admin_tokne="typo")
    with pytest.raises(ValidationError, match="base_ur"):
        EngineSpec(name="x", base_ur="http://x")


def test_engine_args_and_env(monkeypatch, tmp_path) -> None:
    assert parse_engine_arg("http://127.0.0.1:8100") == EngineSpec(
        name="127.0.0.1:8100", kind=EngineKind.BUNDLED, base_url="http://127.0.0.1:8100"
    )
    assert parse_engine_arg("vllm=http://h:9/").kind is EngineKind.VLLM
    engines = [{"name": "a", "kind": "sglang", "base_url": "http://a:1"}]
    monkeypatch.setenv("KVGUARD_ENGINES", json.dumps(engines))
    path = tmp_path / "engines.toml"
    path.write_text('[[engines]]\nname = "b"\nkind = "vllm"\nbase_url = "http://b:2"\n')
    settings = GatewaySettings(engines_file=path)
    assert [(s.name, s.kind) for s in settings.engine_specs()] == [
        ("b", EngineKind.VLLM),
        ("a", EngineKind.SGLANG),
    ]
