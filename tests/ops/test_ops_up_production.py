"""`kvguard up --profile production-like` runs compose.yaml's topology as local processes: a key
issued once works on both gateway replicas (shared PostgreSQL), the request goes through the
prefill/decode split, and Prometheus scrapes every role with the alert rules loaded."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from ops_stack import base_env, chat, prom_query

from dashboards.alerts import ALERTS
from kvguard.localservices import free_port
from kvguard.testing import interruptible


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
        capacity = httpx.get(f"http://127.0.0.1:{decode_port}/engine/capacity", timeout=10).json()
        assert {r["role"] for r in capacity["roles"]} == {"prefill", "decode"}
        _assert_prometheus_sees_everything(prometheus.group(1))
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
    # Both replicas served one request each; wait for the next scrape of each.
    served = 'count(kvguard_gateway_requests_total{outcome!=""})'
    while [r["value"][1] for r in prom_query(url, served)["data"]["result"]] != ["2"]:
        assert time.monotonic() < deadline + 20, prom_query(url, served)
        time.sleep(0.5)
