"""`kvguard up --profile production-like` runs compose.yaml's topology as local processes: a key
issued once works on both gateway replicas (shared PostgreSQL), the request goes through the
prefill/decode split, Prometheus scrapes every role (the gateways with their metrics token) with
the alert rules loaded, and the canary probe runner's results reach Prometheus. Each role's command
is compose.yaml's apart from hosts and ports, so the two cannot drift apart."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from ops_stack import base_env, chat, prom_query

from canary.metrics import PROBE_LAST_RUN
from dashboards.alerts import ALERTS
from kvguard.localservices import free_port
from kvguard.testing import interruptible
from kvguard.up_production import MIGRATE, production_env, production_roles

COMPOSE = yaml.safe_load((Path(__file__).resolve().parents[2] / "compose.yaml").read_text())
# what differs between the hosts: addresses, and where the heartbeat file lives
WHERE = {"--host", "--port", "--prefill-url", "--gateway", "--heartbeat"}
# compose's variables that name a host, the OTel collector the local profile does not run, or the
# proxy it does not run (compose lists nginx's fixed address as the one proxy to believe)
ELSEWHERE = {"KVGUARD_TRANSFER_HOST", "KVGUARD_OTLP_ENDPOINT", "KVGUARD_TRUSTED_PROXIES"}


def _without_where(command: list[str]) -> list[str]:
    return ["<where>" if i and command[i - 1] in WHERE else arg for i, arg in enumerate(command)]


def _service(role: str) -> str:
    names = {"backend (prefill)": "prefill", "backend (decode)": "decode"}
    return names.get(role, "gateway" if role.startswith("gateway") else role.replace(" ", "-"))


def test_roles_run_composes_commands_apart_from_hosts_and_ports(tmp_path: Path) -> None:
    args = argparse.Namespace(
        host="127.0.0.1", port=9000, backend_port=9100, prefill_port=9101, gateway_replicas=2
    )
    args.data_dir = tmp_path
    env = production_env("postgresql://db", "redis://r", "http://127.0.0.1:9100")
    roles = production_roles(args, env)
    services: dict[str, Any] = COMPOSE["services"]
    long_running = {
        name
        for name, s in services.items()
        if s.get("image", "").startswith("kvguard") and s.get("restart") != "no"
    }
    assert {_service(r.name) for r in roles} == long_running
    assert len([r for r in roles if _service(r.name) == "gateway"]) == 2
    for role in roles:
        prefix, command = role.argv[:3], role.argv[3:]
        assert prefix == [sys.executable, "-m", "kvguard"], role.name
        compose = services[_service(role.name)]
        assert _without_where(command) == _without_where(compose["command"]), role.name
        assert role.env is not None
        missing = set(compose.get("environment", {})) - set(role.env) - ELSEWHERE
        assert not missing, (role.name, missing)
    assert services["migrate"]["command"] == MIGRATE


def _free_pair() -> int:
    """A port p with p + 1 also free (the two gateway replicas)."""
    for _ in range(20):
        port = free_port()
        try:
            import socket

            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def test_production_like_profile(tiny_checkpoint: str, tmp_path: Path) -> None:
    port, decode_port, prefill_port = _free_pair(), free_port(), free_port()
    env = base_env(KVGUARD_MODEL=tiny_checkpoint)
    argv = [sys.executable, "-m", "kvguard", "up", "--profile", "production-like"]
    argv += ["--port", str(port), "--backend-port", str(decode_port)]
    argv += ["--prefill-port", str(prefill_port), "--data-dir", str(tmp_path)]
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=interruptible,
        )
    try:
        deadline = time.monotonic() + 180
        while "Press Ctrl-C" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        output = log.read_text()
        assert "all roles healthy" in output, output
        key = re.search(r"API key \(shown once\): (\S+)", output)
        prometheus = re.search(r"Prometheus .*: (http://\S+)", output)
        assert key is not None and prometheus is not None, output
        for replica in (port, port + 1):
            ok = chat(f"http://127.0.0.1:{replica}", key.group(1), "Repeat exactly: hi")
            assert ok.status_code == 200, ok.text
        capacity_url = f"http://127.0.0.1:{decode_port}/engine/capacity"
        assert httpx.get(capacity_url, timeout=10).status_code == 401  # the gateway's alone
        token = re.search(r"Authorization: Bearer (\S+)' \\\n", output)
        assert token is not None, output
        engine_auth = {"Authorization": f"Bearer {token.group(1)}"}
        capacity = httpx.get(capacity_url, headers=engine_auth, timeout=10).json()
        assert {r["role"] for r in capacity["roles"]} == {"prefill", "decode"}
        _assert_prometheus_sees_everything(prometheus.group(1))
        _assert_the_probe_results_reach_prometheus(prometheus.group(1))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert "stopping" in log.read_text()


def _assert_prometheus_sees_everything(url: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        up = prom_query(url, "up")["data"]["result"]
        jobs = sorted((r["metric"]["job"], r["value"][1]) for r in up)
        if len(jobs) == 4 and all(value == "1" for _, value in jobs):
            break
        assert time.monotonic() < deadline, jobs
        time.sleep(0.5)
    assert [job for job, _ in jobs] == ["kvguard-engine"] * 2 + ["kvguard-gateway"] * 2
    groups = httpx.get(url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert {r["name"] for g in groups for r in g["rules"]} == {a.name for a in ALERTS}
    # Both replicas served (the test's chats; replica 1 also the probes'); wait for the next
    # scrape of each (an unauthorized scrape leaves no series: /metrics needs the metrics token).
    served = 'count(count by (instance) (kvguard_gateway_requests_total{outcome!=""}))'
    while [r["value"][1] for r in prom_query(url, served)["data"]["result"]] != ["2"]:
        assert time.monotonic() < deadline + 20, prom_query(url, served)
        time.sleep(0.5)


def _assert_the_probe_results_reach_prometheus(url: str) -> None:
    """The probe runner's first round (at start) is reported to a gateway and scraped."""
    deadline = time.monotonic() + 120
    while not prom_query(url, PROBE_LAST_RUN)["data"]["result"]:
        assert time.monotonic() < deadline, "no probe run reached Prometheus"
        time.sleep(1.0)
