"""Operator secrets: weak ones refused at start, guessed ones throttled.

Attacker: someone who can reach the admin API (or ``/metrics``) and guesses operator tokens, and
an operator who deploys a guessable secret (``a``, ``password``, 32 x ``a``) or one secret for
two roles (a scrape credential that is also the admin's).

Proves: ``kvguard gateway`` in production mode refuses each weak or shared secret before serving,
with exit status 2 and exactly one line naming the variable (a real process, and the same code
path in-process for every case); a strong, distinct set starts. Against the real gateway under
uvicorn, an address that sent ``operator_failures_per_minute`` wrong admin tokens gets 429 with
``Retry-After`` for every further attempt (the right token too: a guesser learns nothing), the
same budget covers ``/metrics``, tenants are unaffected, and another address still gets in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from hostile_harness import ServedGateway, gateway_settings, openai_error, served_gateway

from canary.config import new_key
from kvguard.cli import main

STRONG = {
    "KVGUARD_ADMIN_TOKEN": new_key(),
    "KVGUARD_METRICS_TOKEN": new_key(),
    "KVGUARD_CANARY_KEY": new_key(),
    "KVGUARD_ENGINE_TOKEN": new_key(),
}
WEAK: dict[str, tuple[dict[str, str], str]] = {
    "admin-a": ({"KVGUARD_ADMIN_TOKEN": "a"}, "KVGUARD_ADMIN_TOKEN is 1 characters"),
    "admin-password": ({"KVGUARD_ADMIN_TOKEN": "password"}, "KVGUARD_ADMIN_TOKEN is 8"),
    "admin-repeated": ({"KVGUARD_ADMIN_TOKEN": "ab" * 20}, "KVGUARD_ADMIN_TOKEN is too predict"),
    "metrics-is-admin": (
        {"KVGUARD_METRICS_TOKEN": STRONG["KVGUARD_ADMIN_TOKEN"]},
        "KVGUARD_ADMIN_TOKEN and KVGUARD_METRICS_TOKEN must be different",
    ),
    "canary-32a": ({"KVGUARD_CANARY_KEY": "a" * 32}, "KVGUARD_CANARY_KEY is too predictable"),
    "engine-is-admin": (
        {"KVGUARD_ENGINE_TOKEN": STRONG["KVGUARD_ADMIN_TOKEN"]},
        "KVGUARD_ADMIN_TOKEN and KVGUARD_ENGINE_TOKEN must be different",
    ),
    "canary-is-admin": (
        {"KVGUARD_CANARY_KEY": STRONG["KVGUARD_ADMIN_TOKEN"]},
        "KVGUARD_CANARY_KEY and KVGUARD_ADMIN_TOKEN must be different",
    ),
    # Issue 32, finding 4: each of these used to start.
    "engine-alphabet": (
        {"KVGUARD_ENGINE_TOKEN": "abcdefghijklmnopqrstuvwx"},
        "KVGUARD_ENGINE_TOKEN is too predictable",
    ),
    "cache-salt-a": ({"KVGUARD_CACHE_SALT_KEY": "a"}, "KVGUARD_CACHE_SALT_KEY is 1 characters"),
    "cache-salt-is-admin": (
        {"KVGUARD_CACHE_SALT_KEY": STRONG["KVGUARD_ADMIN_TOKEN"]},
        "KVGUARD_ADMIN_TOKEN and KVGUARD_CACHE_SALT_KEY must be different",
    ),
    "canary-is-engine": (  # the engines hold the engine token
        {"KVGUARD_CANARY_KEY": STRONG["KVGUARD_ENGINE_TOKEN"]},
        "KVGUARD_ENGINE_TOKEN and KVGUARD_CANARY_KEY must be different",
    ),
    "previous-canary-is-admin": (
        {"KVGUARD_CANARY_PREVIOUS_KEYS": json.dumps({"7": STRONG["KVGUARD_ADMIN_TOKEN"]})},
        "KVGUARD_CANARY_PREVIOUS_KEYS[7] and KVGUARD_ADMIN_TOKEN must be different",
    ),
    "previous-canary-is-current": (
        {"KVGUARD_CANARY_PREVIOUS_KEYS": json.dumps({"7": STRONG["KVGUARD_CANARY_KEY"]})},
        "KVGUARD_CANARY_KEY and KVGUARD_CANARY_PREVIOUS_KEYS[7] must be different",
    ),
}


def _production_env(tmp_path: Any, **changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    env.update(STRONG)
    env.update(
        KVGUARD_MODE="production",
        KVGUARD_REDIS_URL="redis://127.0.0.1:1/0",
        KVGUARD_DATA_DIR=str(tmp_path),
    )
    env.update(changes)
    return env


def _refusal(role: list[str], env: dict[str, str]) -> str:
    """The one line a ``kvguard`` process that refuses its settings prints (exit status 2)."""
    argv = [sys.executable, "-m", "kvguard.cli", *role]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    return line


def test_the_marker_key_reused_as_the_engine_token_stops_the_real_process(tmp_path) -> None:
    """The two settings classes of one process are checked together: a canary key that is also
    the engine token (which every engine holds) is refused, in one line naming both."""
    env = _production_env(tmp_path, KVGUARD_CANARY_KEY=STRONG["KVGUARD_ENGINE_TOKEN"])
    line = _refusal(["gateway", "--port", "0"], env)
    assert "KVGUARD_ENGINE_TOKEN and KVGUARD_CANARY_KEY must be different" in line
    assert STRONG["KVGUARD_ENGINE_TOKEN"] not in line


def test_an_engine_with_a_guessable_token_stops_with_one_line(tmp_path) -> None:
    env = _production_env(tmp_path, KVGUARD_ENGINE_TOKEN="abcdefghijklmnopqrstuvwxyz0123")
    line = _refusal(["backend", "unified", "--port", "1"], env)  # refused before any bind
    assert "KVGUARD_ENGINE_TOKEN is too predictable" in line


def test_a_weak_admin_token_stops_the_real_process_with_one_line(tmp_path) -> None:
    env = _production_env(tmp_path, KVGUARD_ADMIN_TOKEN="password")
    line = _refusal(["gateway", "--port", "0"], env)
    assert line.startswith("kvguard gateway: cannot start: ")
    assert "KVGUARD_ADMIN_TOKEN is 8 characters long" in line
    assert "password" not in line  # the refused secret is never echoed


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The apps ``kvguard gateway`` would serve (uvicorn's loop is not started)."""
    apps: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: apps.append(self.config.app))
    return apps


@pytest.mark.parametrize("case", sorted(WEAK))
def test_weak_or_shared_secrets_are_refused_at_start(
    case: str, served: list[Any], monkeypatch: pytest.MonkeyPatch, capsys, tmp_path
) -> None:
    changes, expected = WEAK[case]
    for name in [n for n in os.environ if n.startswith("KVGUARD_")]:
        monkeypatch.delenv(name)
    for name, value in _production_env(tmp_path, **changes).items():
        monkeypatch.setenv(name, value)
    assert main(["gateway", "--port", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert served == []


def test_a_strong_distinct_set_starts(
    served: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    for name in [n for n in os.environ if n.startswith("KVGUARD_")]:
        monkeypatch.delenv(name)
    for name, value in _production_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    assert main(["gateway", "--port", "0"]) == 0
    assert len(served) == 1


# -- guessing the admin token --------------------------------------------------------------------

BUDGET = 5


@pytest.fixture
def throttled(sqlite_url: str, engine: Any) -> Iterator[ServedGateway]:
    settings = gateway_settings(
        sqlite_url, engine.url, operator_failures_per_minute=BUDGET, metrics_token=new_key()
    )
    with served_gateway(settings) as served:
        yield served


def test_repeated_wrong_admin_tokens_are_throttled(throttled: ServedGateway) -> None:
    gw = throttled
    _, key = gw.create_tenant("bystander")
    wrong = {"Authorization": "Bearer not-the-admin-token"}
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        for _ in range(BUDGET):
            assert client.get("/admin/tenants", headers=wrong).status_code == 401
        started = time.monotonic()
        refused = client.get("/admin/tenants", headers=wrong)
        assert refused.status_code == 429, refused.text
        assert openai_error(refused)["code"] == "too_many_failed_credentials"
        assert int(refused.headers["retry-after"]) >= 1
        # While throttled even the right token is not compared: a guesser learns nothing.
        assert client.get("/admin/tenants", headers=gw.admin).status_code == 429
        assert client.get("/metrics", headers=gw.admin).status_code == 429  # one budget
        # Tenants are not operators: their requests are unaffected.
        tenant = client.get("/v1/usage", headers={"Authorization": f"Bearer {key}"})
        assert tenant.status_code == 200
        # The budget drains (BUDGET per minute): one more try is allowed after 60 / BUDGET s.
        wait = 60 / BUDGET - (time.monotonic() - started)
        assert wait > 0  # the refusals above came quicker than one drained failure
    # Another address (127.0.0.2 is loopback too) is not throttled by this one's failures.
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=gw.url, transport=transport, timeout=10) as other:
        assert other.get("/admin/tenants", headers=gw.admin).status_code == 200
