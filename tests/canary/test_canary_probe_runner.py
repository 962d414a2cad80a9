"""The probe runner against two real bundled engines (pools 256 and 512, one model) behind the
gateway (uvicorn on 127.0.0.1; PostgreSQL and Redis where it stores something): the schedule
(``kvguard canary probe`` without ``--once``, a real process stopped with Ctrl-C), the probe keys'
reuse and revocation, each engine probed at its own limit, and B pinned to A's engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import anyio
import httpx
import pytest
from canary_harness import TEST_CANARY_KEY, canary_gateway

import canary.probes
from canary.markers import MarkerCodec
from canary.probes import GatewayClient, ProbeRunner
from kvguard.cli import main
from kvguard.localservices import free_port
from kvguard.testing import EngineProcess, interruptible

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: str) -> Iterator[list[dict[str, str]]]:
    """Two real engines of one model, started in parallel: pools (and windows) 256 and 512."""
    env = {**os.environ, "KVGUARD_TORCH_THREADS": "1"}
    started = {}
    try:
        for name, pool in (("small", 256), ("large", 512)):
            port = free_port()
            argv = [sys.executable, "-m", "kvguard", "backend", "unified", "--port", str(port)]
            argv += ["--model", tiny_checkpoint, "--page-size", "16"]
            argv += ["--pool-tokens", str(pool), "--context-window", str(pool)]
            started[name] = EngineProcess(argv, f"http://127.0.0.1:{port}", env)
        for engine in started.values():
            engine.wait_healthy()
        yield [{"name": name, "base_url": engine.url} for name, engine in started.items()]
    finally:
        for engine in started.values():
            engine.stop()


async def _keys(gw, tenant: str) -> list[dict]:
    r = await gw.client.get(f"/admin/tenants/{tenant}/keys", headers=gw.admin)
    assert r.status_code == 200, r.text
    return r.json()


def _two_rounds_then_ctrl_c(proc: subprocess.Popen[str]) -> str:
    """Read the schedule's tables until two rounds printed, then Ctrl-C; the whole output."""
    assert proc.stdout is not None
    out, rounds, deadline = [], 0, time.monotonic() + 120
    while rounds < 2:
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(out)
        out.append(line)
        rounds += line.rstrip().endswith("passed")
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    return "".join(out) + rest


async def test_the_schedule_reuses_its_keys_and_revokes_them_when_stopped(
    engines, gateway_settings, canary_settings, postgres_url, redis_url
) -> None:
    settings = gateway_settings(database_url=postgres_url, redis_url=redis_url, engines=engines)
    async with canary_gateway(settings, canary_settings()) as gw:
        env = {
            **os.environ,
            "KVGUARD_MODE": "development",
            "KVGUARD_CANARY_KEY": TEST_CANARY_KEY,
            "KVGUARD_CANARY_PROBE_INTERVAL_S": "0.05",
        }
        argv = [sys.executable, "-m", "kvguard", "canary", "probe", "--gateway", gw.url]
        proc = subprocess.Popen(
            [*argv, "--kind", "cross_tenant"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=interruptible,
        )
        try:
            out = await anyio.to_thread.run_sync(_two_rounds_then_ctrl_c, proc)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out
        assert out.count("1/1 passed") >= 2, out
        runs = (await gw.client.get("/admin/canary/probe-runs", headers=gw.admin)).json()
        assert len({r["run_id"] for r in runs}) >= 2 and all(r["passed"] for r in runs)
        for tenant in ("canary-probe-a", "canary-probe-b"):
            [key] = await _keys(gw, tenant)  # one key for every round
            assert key["revoked_at"] is not None  # and none left live at Ctrl-C

        # A key near its expiry is replaced, and the replaced one revoked at once.
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            client = GatewayClient(http, admin_token=settings.admin_secret())
            runner = ProbeRunner(client, MarkerCodec(canary_settings().keyring()))
            await runner.run([])
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(canary.probes, "KEY_RENEW_BEFORE_S", 10**6)
                await runner.run([])
            live = [k for k in await _keys(gw, "canary-probe-a") if k["revoked_at"] is None]
            assert len(await _keys(gw, "canary-probe-a")) == 3 and len(live) == 1
            await runner.close()
        assert all(k["revoked_at"] for k in await _keys(gw, "canary-probe-a"))


async def test_two_engines_each_probed_at_its_own_limit_and_b_pinned_to_a(
    engines, gateway_settings, canary_settings, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("KVGUARD_CANARY_KEY", TEST_CANARY_KEY)
    async with canary_gateway(gateway_settings(engines=engines), canary_settings()) as gw:
        argv = ["canary", "probe", "--gateway", gw.url, "--once", "--no-report"]
        argv += ["--kind", "capacity", "--kind", "cross_tenant", "--kind", "abort"]
        status = await anyio.to_thread.run_sync(lambda: main(argv))
        table = capsys.readouterr().out
    assert status == 0 and "10/10 passed" in table, table
    rows = table.splitlines()[2:-1]
    # Past the small engine's own limit the request still fits the large one, and only there.
    for label in ("limit+1: ", "1.5x: "):
        [row] = [r for r in rows if label in r and " of 256 tokens" in r]
        assert row.split()[1] == "large" and row.endswith("| 200"), table
        [row] = [r for r in rows if label in r and " of 512 tokens" in r]
        assert row.endswith("| 400 context_length_exceeded"), table
    # Round robin sends each of B's first tries to the other engine; the probe sends it again to
    # A's.
    [pair] = [r for r in rows if r.startswith("cross_tenant")]
    a_engine = pair.split()[1]
    assert f"A 200 on {a_engine}; B near the limit 200 on {a_engine} (try 2), " in pair, table
    assert f"B short 200 on {a_engine} (try 2), A's marker absent" in pair, table
