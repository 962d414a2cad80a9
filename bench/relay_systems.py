"""The systems the relay benchmark starts: the stand-in engine, the two floors, the kvguard
gateway (PostgreSQL, Redis, tenants) and the LiteLLM proxy, each as its own process.

``Systems`` is a context manager that starts what it is asked for and stops all of it. Placement
(``RELAY_CPU`` / ``LOAD_CPU``): every relay under test runs under ``taskset -c RELAY_CPU``; the
benchmark process pins itself to ``LOAD_CPU`` first, so the load generator, the stand-in, Redis and
PostgreSQL (its children) share that other core. On a one-core machine nothing is pinned.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.litellm_proxy import PROXY_KEY, PROXY_MODEL, ensure_litellm_venv, start_litellm_proxy
from bench.relay_standin import MODEL
from kvguard.localservices import free_port, postgres_server, redis_server

PUMP_NO_CHECKS = "kvguard pump, checks off"
RELAY_CPU = 0
LOAD_CPU = 1
TENANT_PLAN = {"requests_per_minute": 1_000_000, "tokens_per_minute": 100_000_000}


@dataclass(frozen=True, slots=True)
class Relay:
    """One system under test: where to send, the model name it serves, its process."""

    name: str
    port: int
    model: str
    pid: int | None  # None: the direct path (no relay)
    keys: tuple[str, ...] = ()  # bearer keys to cycle through (empty: no Authorization header)


def pinned() -> bool:
    return (os.cpu_count() or 1) >= 2


def pin_self() -> None:
    """The benchmark (the load generator) and its children go to LOAD_CPU."""
    if pinned():
        os.sched_setaffinity(0, {LOAD_CPU})


def _on_relay_cpu(argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(RELAY_CPU), *argv] if pinned() else argv


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_http(url: str, proc: subprocess.Popen[Any], log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited; log tail: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s: {log.read_text()[-2000:]}")


class Systems:
    """Starts processes into one ExitStack; ``close`` stops them in reverse order. A benchmark
    killed with SIGTERM exits through its ``finally`` (``close``), instead of leaving the stand-in,
    Redis, PostgreSQL and the relays running on the machine the next benchmark measures on."""

    def __init__(self, tmp: Path) -> None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        self.tmp = tmp
        self.stack = ExitStack()
        self.standin_ports: list[int] = []
        self.standin_pid = 0

    def close(self) -> None:
        self.stack.close()

    def _spawn(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> tuple:
        log = self.tmp / f"{name}.log"
        proc = subprocess.Popen(
            argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=cwd or Path.cwd()
        )
        self.stack.callback(_stop, proc)
        return proc, log

    def standin(self, *, engines: int, interval_s: float) -> str:
        """The stand-in on ``engines`` ports (one process); the first port's URL."""
        self.standin_ports = [free_port() for _ in range(engines)]
        argv = [
            sys.executable,
            "-m",
            "bench.relay_standin",
            "--interval-ms",
            str(interval_s * 1000),
        ]
        for port in self.standin_ports:
            argv += ["--port", str(port)]
        proc, log = self._spawn("standin", argv)
        self.standin_pid = proc.pid
        url = f"http://127.0.0.1:{self.standin_ports[0]}"
        _wait_http(f"{url}/health", proc, log)
        return url

    def floor(self, kind: str, upstream: str) -> Relay:
        port = free_port()
        argv = [sys.executable, "-m", "bench.relay_floors", kind, "--port", str(port)]
        proc, log = self._spawn(f"floor-{kind}", _on_relay_cpu([*argv, "--upstream", upstream]))
        _wait_http(f"http://127.0.0.1:{port}/", proc, log)
        name = "aiohttp pass-through" if kind == "aiohttp" else "lean asyncio relay"
        return Relay(name, port, MODEL, proc.pid)

    def pump_without_checks(self, upstream: str) -> Relay:
        """The gateway's data plane with every check off (``bench.relay_candidates``'s
        ``pump-no-checks``): the floor its checks come on top of."""
        port = free_port()
        argv = [sys.executable, "-m", "bench.relay_candidates", "serve", "pump-no-checks"]
        argv += ["--port", str(port), "--upstream", upstream]
        proc, log = self._spawn("pump-no-checks", _on_relay_cpu(argv))
        _wait_http(f"http://127.0.0.1:{port}/", proc, log)
        return Relay(PUMP_NO_CHECKS, port, MODEL, proc.pid)

    def services(self) -> tuple[str, str]:
        """Private Redis and PostgreSQL (URLs)."""
        redis = self.stack.enter_context(redis_server())
        postgres = self.stack.enter_context(postgres_server())
        return redis.url, postgres.url

    def gateways(
        self, checkouts: dict[str, Path | None], *, canary_rate: float = 0.1
    ) -> list[Relay]:
        """One gateway per checkout (name -> checkout; None: this one) in front of the stand-in's
        first port, with private Redis and PostgreSQL and 10 tenants the canary marks at
        ``canary_rate``: what the side-by-side tools compare."""
        redis_url, database_url = self.services()
        keys = tuple(create_tenants(database_url, 10, canary_rate=canary_rate))
        return [
            self.gateway(
                redis_url=redis_url,
                database_url=database_url,
                engines=1,
                keys=keys,
                source=checkout,
                name=name,
            )
            for name, checkout in checkouts.items()
        ]

    def gateway(
        self,
        *,
        redis_url: str,
        database_url: str,
        engines: int,
        keys: tuple[str, ...],
        source: Path | None = None,
        name: str = "kvguard gateway",
    ) -> Relay:
        """``kvguard gateway`` in production mode in front of the first ``engines`` ports;
        ``source``: run the gateway code of that checkout instead of this one."""
        port = free_port()
        specs = [
            {"name": f"standin-{i}", "kind": "bundled", "base_url": f"http://127.0.0.1:{p}"}
            for i, p in enumerate(self.standin_ports[:engines])
        ]
        env = {
            **os.environ,
            **gateway_env(redis_url, database_url),
            "KVGUARD_ENGINES": json.dumps(specs),
            "KVGUARD_MIGRATE_ON_START": "false",
            "KVGUARD_DATA_DIR": str(self.tmp / f"gateway-data-{port}"),  # not the working dir
        }
        cwd = None
        if source is not None:
            # ``python -m`` puts its working directory first on sys.path, before PYTHONPATH:
            # the checkout's code runs only when the process starts inside it
            cwd = source.resolve()
            env["PYTHONPATH"] = str(cwd)
        argv = [sys.executable, "-m", "kvguard", "gateway", "--port", str(port)]
        log_name = f"gateway-{engines}-{port}"
        argv = _on_relay_cpu([*argv, "--log-level", "warning"])
        proc, log = self._spawn(log_name, argv, env, cwd)
        _wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        _wait_routable(port, keys[0], proc, log)
        return Relay(name, port, MODEL, proc.pid, keys)

    def litellm(self, upstream: str) -> Relay | str:
        """The LiteLLM proxy (its own venv, offline; ``bench_proxy``'s), or why it is not
        measured."""
        missing = ensure_litellm_venv()
        if missing is not None:
            return missing
        prefix = _on_relay_cpu([])
        proc, url = start_litellm_proxy(upstream, MODEL, self.tmp, prefix=tuple(prefix))
        self.stack.callback(_stop, proc)
        log = self.tmp / "litellm.log"
        try:
            _wait_http(f"{url}/health/liveliness", proc, log, timeout_s=240)
        except RuntimeError as exc:
            return str(exc)
        port = int(url.rsplit(":", 1)[1])
        return Relay("LiteLLM proxy", port, PROXY_MODEL, proc.pid, (PROXY_KEY,))


def gateway_env(redis_url: str, database_url: str) -> dict[str, str]:
    return {
        "KVGUARD_MODE": "production",
        "KVGUARD_DATABASE_URL": database_url,
        "KVGUARD_REDIS_URL": redis_url,
        "KVGUARD_ADMIN_TOKEN": _SECRETS["admin"],
        "KVGUARD_METRICS_TOKEN": _SECRETS["metrics"],
        "KVGUARD_CANARY_ENABLED": "1",
        "KVGUARD_CANARY_KEY": _SECRETS["canary"],
        "KVGUARD_CANARY_KEY_ID": "1",
        "KVGUARD_ENGINE_TOKEN": _SECRETS["engine"],  # presented to the stand-in, which ignores it
    }


_SECRETS = {name: secrets.token_urlsafe(32) for name in ("admin", "metrics", "canary", "engine")}


def _wait_routable(port: int, key: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the gateway has read the stand-in's capacity and answers a completion."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline = time.monotonic() + 60
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {log.read_text()[-2000:]}")
        try:
            response = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=10,
            )
        except httpx.HTTPError as exc:
            last = repr(exc)
        else:
            if response.status_code == 200:
                return
            last = response.text[:300]
        time.sleep(0.3)
    raise RuntimeError(f"gateway never answered a completion: {last}; {log.read_text()[-2000:]}")


def create_tenants(database_url: str, count: int, *, canary_rate: float) -> list[str]:
    """Migrate the database and create ``count`` tenants with one key each; the keys."""
    from contracts.sql import make_session_factory, session_scope
    from gateway.db.session import make_engine, upgrade_database
    from gateway.domain import TenantPlan
    from gateway.services.tenants import create_tenant

    engine = make_engine(database_url)
    upgrade_database(engine)
    keys = []
    plan = TenantPlan(**TENANT_PLAN)
    with session_scope(make_session_factory(engine)) as session:
        for i in range(count):
            created = create_tenant(
                session, name=f"bench-{i:05d}", plan=plan, canary_sample_rate=canary_rate
            )
            keys.append(created.first_key.key)
    engine.dispose()
    return keys


@contextmanager
def started(tmp: Path) -> Iterator[Systems]:
    systems = Systems(tmp)
    try:
        yield systems
    finally:
        systems.close()
