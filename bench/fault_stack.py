"""A real stack to break on purpose: gateway + decode + prefill processes, private Redis and
PostgreSQL behind cuttable links, everything on 127.0.0.1.

Lifecycle (``fault_stack``): start private Redis and PostgreSQL (``kvguard.localservices``) ->
put a ``TcpLink`` in front of each (the gateway only ever talks through the links, so a test can
make a service unreachable and bring it back without losing its data) -> migrate -> start
prefill, decode and the gateway as ``kvguard`` processes (logs to files; a full pipe would stall
a role) -> create a load tenant with a concurrency cap -> (faults) -> stop everything.

Roles can be killed (SIGKILL: no goodbye) and restarted on the same port, so the gateway and
decode find them where they were. Nothing here asserts; ``bench.faults`` measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvguard.localservices import RunningService, free_port, postgres_server, redis_server
from kvguard.testing import stop_process, wait_for, wait_for_health

KVGUARD = [sys.executable, "-m", "kvguard"]
BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "backend" / "bundled" / "kvguard-tiny"
MODEL_NAME = "kvguard-tiny"
ENGINE_NAME = "bundled"


# -- a TCP link that can be cut -------------------------------------------------------------------


class TcpLink:
    """127.0.0.1:port -> target, forwarding bytes both ways until ``cut()``.

    ``cut`` stops listening (new connections are refused) and resets every open connection, as
    a dead host or a partition would; ``restore`` listens again on the same port. ``freeze``
    holds every byte, both ways, with the connections open, as a stopped server whose kernel
    still acknowledges would; ``thaw`` forwards again. The forwarder runs its own event loop in a
    daemon thread, so it keeps working while the caller's loop is busy or blocked.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._thread.start()
        self.restore()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def restore(self) -> None:
        self._call(self._listen())

    def cut(self) -> None:
        self._call(self._cut())

    def freeze(self) -> None:
        self._call(self._flow(False))  # in effect when this returns

    def thaw(self) -> None:
        self._call(self._flow(True))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cut()
            self._call(self._cancel_pumps())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _cancel_pumps(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _flow(self, flowing: bool) -> None:
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()  # RST, not FIN: the peer sees a broken connection
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        if self._server is None:  # cut while this connection was being set up
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            _pump(reader, up_writer, self._flowing), _pump(up_reader, writer, self._flowing)
        )
        self._writers -= {writer, up_writer}


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flowing: asyncio.Event
) -> None:
    try:
        while data := await reader.read(65536):
            await flowing.wait()
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()  # one side ended: end the other (a cut aborts both with a reset instead)


# -- kvguard processes ----------------------------------------------------------------------------


@dataclass
class Proc:
    """One ``kvguard`` process on a fixed port; killed and restarted on the same port."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        if self.proc is not None:
            self.restarts += 1
        with open(self.log, "ab") as out:
            argv = [*KVGUARD, *self.args, "--port", str(self.port)]
            self.proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=out)
        return self

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        assert self.proc is not None
        wait_for_health(self.proc, self.url, self.name, self.tail, timeout_s)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to say goodbye (a crash, an OOM kill)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)


# -- the stack ------------------------------------------------------------------------------------


@dataclass
class Tenant:
    id: str
    key: str = field(repr=False)
    max_concurrency: int

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass
class FaultStack:
    prefill: Proc
    decode: Proc
    gateway: Proc
    redis_link: TcpLink
    postgres_link: TcpLink
    database_url: str  # direct, not through the link: the harness reads audit rows during faults
    admin_token: str = field(repr=False)
    canary_key: str = field(repr=False)
    tenant: Tenant | None = None
    engine_token: str = field(default="", repr=False)  # the engines take calls only with it
    redis: RunningService | None = None  # the servers behind the links (``frozen`` stops them)
    postgres: RunningService | None = None

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def restart(self, role: Proc) -> None:
        role.start().wait_healthy()

    def wait_routable(self, timeout_s: float = 60.0) -> None:
        """Until the gateway routes to the engine again (fresh capacity, whole path up); the
        timeout names what the gateway last said of its engines."""
        try:
            wait_for(lambda: self.routable(), timeout_s, "the gateway to route to the engine")
        except TimeoutError as exc:
            engines, log = self._engines(), self.gateway.tail()[-1500:]
            raise TimeoutError(f"{exc}; /admin/engines: {engines}; gateway log: {log}") from None

    def routable(self) -> bool:
        engines = self._engines()
        return isinstance(engines, list) and all(e.get("routable") for e in engines)

    def _engines(self) -> Any:
        """The gateway's ``/admin/engines`` (JSON), or why it gave none."""
        try:
            r = httpx.get(self.url + "/admin/engines", headers=self.admin, timeout=5)
        except httpx.HTTPError as exc:
            return f"unreachable: {exc.__class__.__name__}"
        return r.json() if r.status_code == 200 else f"HTTP {r.status_code}"

    def set_override(self, *, allow_unsafe: bool) -> None:
        """The admin override that lets the gateway route to an engine reporting a drill."""
        url = f"{self.url}/admin/engines/{ENGINE_NAME}/override"
        body = {"allow_unsafe": allow_unsafe}
        httpx.put(url, json=body, headers=self.admin, timeout=10).raise_for_status()

    def transfers_in_flight(self) -> bool:
        """Whether prefill is writing KV into decode right now (its own handoff gauge)."""
        return _metric(self.prefill, 'kvguard_engine_handoffs_active{state="transferring"}') > 0

    def drained_pages(self) -> float:
        """Pages decode has freed after a quarantine (abort/failure drain), since it started."""
        return _metric_sum(self.decode, "kvguard_engine_drained_pages_total")

    def staging(self) -> dict[str, float]:
        """Prefill's transfer staging pages: free and total."""
        sample = 'kvguard_engine_staging_pages{state="%s"}'
        return {state: _metric(self.prefill, sample % state) for state in ("free", "total")}

    def pool(self, role: Proc) -> dict[str, float]:
        """The role's KV pool by state (free/owned/shared/quarantined), its size, and how many
        pages a new request could have now (free + idle prefix-cache pages), from its own API."""
        text = httpx.get(role.url + "/metrics", timeout=10).text
        states: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith('kvguard_engine_pool_pages{state="'):
                state = line.split('"')[1]
                states[state] = float(line.rpartition(" ")[2])
        auth = {"Authorization": f"Bearer {self.engine_token}"}
        capacity = httpx.get(role.url + "/engine/capacity", headers=auth, timeout=10).json()
        states["total"] = float(capacity["pool_pages"])
        states["available"] = float(capacity["free_pages"])
        return states

    def create_tenant(self, name: str, *, max_concurrency: int) -> Tenant:
        body = {"name": name, "max_concurrency": max_concurrency, "canary_sample_rate": 0.0}
        r = httpx.post(self.url + "/admin/tenants", json=body, headers=self.admin, timeout=30)
        r.raise_for_status()
        data = r.json()
        return Tenant(data["tenant"]["id"], data["key"]["key"], max_concurrency)

    def audit_rows(self, request_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        """request id -> its audit rows (read straight from PostgreSQL, never through the link)."""
        import psycopg  # local import: only the PostgreSQL path needs the driver

        dsn = self.database_url.replace("postgresql+psycopg://", "postgresql://")
        out: dict[str, list[dict[str, Any]]] = {rid: [] for rid in request_ids}
        with psycopg.connect(dsn) as conn:
            cursor = conn.execute(
                "SELECT request_id, outcome, http_status, error_code FROM request_audit"
                " WHERE request_id = ANY(%s)",
                (request_ids,),
            )
            for request_id, outcome, status, code in cursor.fetchall():
                out[request_id].append({"outcome": outcome, "status": status, "code": code})
        return out


def _metric_lines(role: Proc) -> list[str]:
    try:
        return httpx.get(role.url + "/metrics", timeout=5).text.splitlines()
    except httpx.HTTPError:
        return []


def _metric(role: Proc, sample: str) -> float:
    for line in _metric_lines(role):
        if line.startswith(sample + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


def _metric_sum(role: Proc, name: str) -> float:
    """The sum of every sample of ``name`` (all label values)."""
    lines = _metric_lines(role)
    return sum(
        float(ln.rpartition(" ")[2]) for ln in lines if ln.startswith((name + "{", name + " "))
    )


def _backend_env(log_env: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ,
        "KVGUARD_TORCH_THREADS": "1",
        "KVGUARD_SERVED_MODEL_NAME": MODEL_NAME,
        "GLOG_minloglevel": "2",
        **log_env,
    }


def _migrate(env: dict[str, str]) -> None:
    done = subprocess.run(
        [*KVGUARD, "admin", "migrate"], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"migrate failed: {done.stderr[-2000:]}")


def _roles(
    model: Path, pool_tokens: int, options: tuple[dict[str, str], dict[str, str]], logs: Path
) -> tuple[Proc, Proc]:
    """Prefill and decode (not started); ``options`` are extra settings for each."""
    pool = ["--model", str(model), "--pool-tokens", str(pool_tokens), "--page-size", "16"]
    prefill = Proc(
        "prefill", ["backend", "prefill", *pool], _backend_env(options[0]), logs / "prefill.log"
    )
    decode_args = ["backend", "decode", *pool, "--prefill-url", prefill.url]
    decode = Proc("decode", decode_args, _backend_env(options[1]), logs / "decode.log")
    return prefill, decode


def _gateway_env(
    decode: Proc, redis_link: TcpLink, postgres_link: TcpLink, secrets_: tuple[str, str, str]
) -> dict[str, str]:
    """The gateway reaches Redis and PostgreSQL only through the links; it polls fast, so a
    restarted role is routable again within a second."""
    engine = {"name": ENGINE_NAME, "kind": "bundled", "base_url": decode.url}
    database = f"postgresql+psycopg://postgres@127.0.0.1:{postgres_link.port}/postgres"
    return {
        **os.environ,
        "KVGUARD_DATABASE_URL": database,
        "KVGUARD_REDIS_URL": f"redis://127.0.0.1:{redis_link.port}/0",
        "KVGUARD_ADMIN_TOKEN": secrets_[0],
        "KVGUARD_CANARY_KEY": secrets_[1],
        "KVGUARD_ENGINE_TOKEN": secrets_[2],
        "KVGUARD_ENGINES": json.dumps([engine]),
        "KVGUARD_POLL_INTERVAL_S": "0.5",
        "KVGUARD_CAPACITY_STALE_AFTER_S": "3",
        "KVGUARD_AUDIT_FLUSH_INTERVAL_S": "0.2",
        "KVGUARD_AUTH_CACHE_TTL_S": "0.5",
    }


@contextlib.contextmanager
def fault_stack(
    *,
    model: Path = BUNDLED_MODEL,
    pool_tokens: int = 2048,
    max_concurrency: int = 4,
    prefill_options: dict[str, str] | None = None,
    decode_options: dict[str, str] | None = None,
    log_dir: Path | None = None,
) -> Iterator[FaultStack]:
    """The whole stack, up and routable, with one load tenant; stopped (all of it) at the end.

    ``prefill_options``/``decode_options`` are extra ``KVGUARD_*`` settings for that role
    (e.g. ``{"KVGUARD_HANDOFF_TIMEOUT_S": "2.0"}``).
    """
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvguard-faults-"))
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_server())
        postgres = stack.enter_context(postgres_server())
        redis_link = TcpLink(redis.host, redis.port)
        stack.callback(redis_link.close)
        postgres_link = TcpLink(postgres.host, postgres.port)
        stack.callback(postgres_link.close)
        admin_token, canary_key = secrets.token_urlsafe(32), secrets.token_urlsafe(48)
        engine_token = secrets.token_urlsafe(32)
        credential = {"KVGUARD_ENGINE_TOKEN": engine_token}
        options = (
            {**(prefill_options or {}), **credential},
            {**(decode_options or {}), **credential},
        )
        prefill, decode = _roles(model, pool_tokens, options, logs)
        env = _gateway_env(
            decode, redis_link, postgres_link, (admin_token, canary_key, engine_token)
        )
        _migrate(env)
        gateway = Proc("gateway", ["gateway", "--log-level", "warning"], env, logs / "gw.log")
        for proc in (prefill, decode, gateway):  # they load in parallel
            stack.callback(proc.stop)
            proc.start()
        for proc in (prefill, decode, gateway):
            proc.wait_healthy()
        fs = FaultStack(
            prefill=prefill,
            decode=decode,
            gateway=gateway,
            redis_link=redis_link,
            postgres_link=postgres_link,
            database_url=postgres.url,
            admin_token=admin_token,
            canary_key=canary_key,
            engine_token=engine_token,
            redis=redis,
            postgres=postgres,
        )
        fs.wait_routable()
        fs.tenant = fs.create_tenant("load", max_concurrency=max_concurrency)
        yield fs
