"""Engines take calls only from their own deployment.

Attacker: anything that can reach an engine's port without going through the gateway -- another
container on the compose network (Grafana, nginx, the collector), any local user of a
production-like host (engines listen on 127.0.0.1), a compromised neighbour. It used to be able
to call the OpenAI routes with any ``X-Kvguard-Tenant`` (served as that tenant, no limits, no
firewall), read capacity, and post ``/kv/v1/prefill`` naming any transfer target and page
addresses, making prefill write KV into any registered decode memory.

Proves, against a real prefill + decode pair started with a deployment credential and the gateway
in front of them: every engine route but ``/health`` and ``/metrics`` answers 401 (OpenAI-style,
``invalid_engine_credential``) to no credential, a wrong one and a tenant key, whatever header it
sets; the gateway and decode present the credential (a tenant's request is served end to end
through the handoff), and a gateway without it cannot route to the engine; prefill refuses a
handoff whose transfer target is not a decode peer it knows (403) even with the credential;
production refuses an engine without a credential and a prefill without its decode peers, with
one line each; and compose puts the engines on an internal network of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hostile_harness import ENGINE_MODEL, gateway_settings, openai_error, served_gateway
from test_hostile_fuzz import _handoff_bodies

from canary.config import new_key
from kvguard.cli import main
from kvguard.testing import EngineProcess, launch_engine

REPO = Path(__file__).resolve().parents[2]
TOKEN = new_key()
OPEN = {"/health", "/metrics"}
PAGE = 16


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: str) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    env = {"KVGUARD_ENGINE_TOKEN": TOKEN, "KVGUARD_SERVED_MODEL_NAME": ENGINE_MODEL}
    prefill = launch_engine(tiny_checkpoint, "prefill", env, pool_tokens=512, page_size=PAGE)
    try:
        decode = launch_engine(
            tiny_checkpoint, "decode", env, pool_tokens=512, page_size=PAGE, prefill_url=prefill.url
        )
    except BaseException:
        prefill.stop()
        raise
    yield prefill, decode
    decode.stop()
    prefill.stop()


def _routes(url: str) -> list[tuple[str, str]]:
    """(method, path) of every route the engine serves (its OpenAPI, read with the credential),
    plus the documentation routes."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    spec = httpx.get(url + "/openapi.json", headers=auth, timeout=10).json()
    routes = [(m.upper(), p) for p, item in spec["paths"].items() for m in item]
    return [*routes, ("GET", "/openapi.json"), ("GET", "/docs")]


STRANGERS: dict[str, dict[str, str]] = {
    "none": {},
    "wrong": {"Authorization": "Bearer " + new_key()},
    "tenant-key": {"Authorization": "Bearer kvg_abcdefgh_" + "x" * 32},
    "not-bearer": {"Authorization": TOKEN},
}


def test_every_engine_route_but_health_and_metrics_needs_the_credential(
    pair: tuple[EngineProcess, EngineProcess],
) -> None:
    for engine in pair:
        routes = _routes(engine.url)
        assert ("POST", "/kv/v1/prefill") in routes or ("POST", "/v1/chat/completions") in routes
        for who, headers in STRANGERS.items():
            headers = {**headers, "X-Kvguard-Tenant": "victim"}  # a header it would have trusted
            for method, path in routes:
                r = httpx.request(method, engine.url + path, headers=headers, json={}, timeout=10)
                if path in OPEN:
                    assert r.status_code == 200, (who, method, path, r.status_code)
                    continue
                assert r.status_code == 401, (who, method, path, r.status_code, r.text[:200])
                assert openai_error(r)["code"] == "invalid_engine_credential"
                assert r.headers["www-authenticate"] == "Bearer"


def test_the_gateway_and_decode_present_it(
    pair: tuple[EngineProcess, EngineProcess], sqlite_url: str
) -> None:
    _, decode = pair
    engine = {"name": "pair", "kind": "bundled", "base_url": decode.url}
    body = {"model": ENGINE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    settings = gateway_settings(sqlite_url, decode.url, engines=[engine], engine_token=TOKEN)
    with served_gateway(settings, canary=False) as gw:
        _, key = gw.create_tenant("acme")
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        # decode -> prefill with the credential: the proof held (the gateway says so, not how)
        assert r.json()["kvguard"]["isolation"] == "handoff_verified"
    without = gateway_settings(sqlite_url, decode.url, engines=[engine])
    with served_gateway(without, canary=False) as gw:
        listed = httpx.get(gw.url + "/admin/engines", headers=gw.admin, timeout=10).json()
        assert listed[0]["routable"] is False and "401" in (listed[0]["last_error"] or "")


def _prefill_body(tiny_checkpoint: str, endpoint: str) -> dict[str, Any]:
    example: dict[str, Any] = _handoff_bodies(tiny_checkpoint, endpoint)["/kv/v1/prefill"][
        "example"
    ]
    return example


def test_prefill_writes_only_to_decode_peers_it_knows(
    pair: tuple[EngineProcess, EngineProcess], tiny_checkpoint: str
) -> None:
    prefill, _ = pair
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = _prefill_body(tiny_checkpoint, "10.9.8.7:5000")  # someone else's memory
    r = httpx.post(prefill.url + "/kv/v1/prefill", json=body, headers=auth, timeout=30)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "target_not_allowed"
    # Nothing was computed or reserved for it.
    capacity = httpx.get(prefill.url + "/engine/capacity", headers=auth, timeout=10).json()
    assert capacity["free_pages"] == capacity["pool_pages"], capacity


def test_production_refuses_an_open_engine_in_one_line(tiny_checkpoint: str) -> None:
    child = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    child["KVGUARD_MODE"] = "production"
    argv = [sys.executable, "-m", "kvguard", "backend", "unified", "--port", "1"]
    done = subprocess.run(
        [*argv, "--model", tiny_checkpoint], env=child, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("kvguard backend unified: cannot start")
    assert "KVGUARD_ENGINE_TOKEN must be set" in lines[-1]


@pytest.mark.parametrize(
    ("role", "env", "expected"),
    [
        ("unified", {"KVGUARD_ENGINE_TOKEN": "a" * 32}, "KVGUARD_ENGINE_TOKEN is too predictable"),
        ("prefill", {"KVGUARD_ENGINE_TOKEN": TOKEN}, "KVGUARD_DECODE_PEERS is required"),
    ],
)
def test_production_refuses_a_weak_credential_or_a_prefill_without_peers(
    role: str,
    env: dict[str, str],
    expected: str,
    tiny_checkpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same path in-process (``kvguard backend ROLE``'s main), for the other refusals."""
    for name in [n for n in os.environ if n.startswith("KVGUARD_")]:
        monkeypatch.delenv(name)
    for name, value in {"KVGUARD_MODE": "production", **env}.items():
        monkeypatch.setenv(name, value)
    assert main(["backend", role, "--port", "1", "--model", tiny_checkpoint]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"kvguard backend {role}: cannot start") and expected in line, line


def test_compose_gives_the_engines_a_network_of_their_own() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert compose["networks"]["engines"] == {"internal": True}
    services = compose["services"]
    on_engines = {
        name for name, svc in services.items() if "engines" in (svc.get("networks") or [])
    }
    assert on_engines == {"prefill", "decode", "gateway", "prometheus", "otel-collector"}
    for engine in ("prefill", "decode"):
        assert services[engine]["networks"] == ["engines"]  # and no other
        assert "KVGUARD_ENGINE_TOKEN" in services[engine]["environment"]
    assert "KVGUARD_ENGINE_TOKEN" in compose["x-gateway-env"]
    assert services["prefill"]["environment"]["KVGUARD_DECODE_PEERS"] == '["decode"]'
