"""Private Redis, PostgreSQL and Prometheus servers started from the installed binaries.

Used by the test suite (each session gets its own servers on free ports in temp dirs, so parallel
sessions never collide and no test depends on a service left running by hand) and by
`kvguard up --profile production-like`. Lifecycle of a server: locate binary -> prepare data dir ->
start child process -> wait until it answers -> (use) -> stop (terminate, then kill) -> remove dir.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POSTGRES_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


class ServiceUnavailable(RuntimeError):
    """A server binary is missing or the server did not come up; the message says which."""


@dataclass(frozen=True, slots=True)
class RunningService:
    name: str
    host: str
    port: int
    url: str
    data_dir: Path
    pid: int | None = None  # the server's process (``frozen`` stops it and its children)


# Ports this process has already handed out. Two servers told to use one port would race, and
# the loser's health check would be answered by the winner.
_HANDED_OUT: set[int] = set()
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_UNCLAIMED_SPAN = 16_384  # ports below the ephemeral range to choose from


def unclaimed_ports() -> range | None:
    """Ports just below the kernel's ephemeral range, or None where it cannot be read or leaves
    too little room. Every outgoing connection takes its local port from the ephemeral range: a
    port picked there (a bind to port 0) can be taken by some process's client socket before
    the server told to use it binds it -- ``kvguard up`` starting several roles that connect to
    PostgreSQL and Redis meanwhile failed that way ("address already in use")."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(10_000, low - _UNCLAIMED_SPAN)
    return range(start, low) if low - start >= 1024 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never one this process handed out before: a random one of
    ``unclaimed_ports`` (no client socket takes it meanwhile; random, so that processes picking
    at the same time rarely meet), else one the kernel picks."""
    ports = unclaimed_ports()
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, ports[secrets.randbelow(len(ports))] if ports else 0))
            except OSError:  # taken: another
                continue
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise ServiceUnavailable(f"no fresh free port on {host} after 1000 tries")


def find_binary(name: str, extra_dirs: list[Path] | None = None) -> Path:
    for directory in extra_dirs or []:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    found = shutil.which(name)
    if found is None:
        raise ServiceUnavailable(
            f"{name} is not installed; run `make test` or `make up` (they install it), "
            "or install the Debian package that provides it"
        )
    return Path(found)


def _wait_for_port(proc: subprocess.Popen[bytes], name: str, host: str, port: int) -> None:
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceUnavailable(f"{name} exited with status {proc.returncode} during start-up")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise ServiceUnavailable(f"{name} did not listen on {host}:{port} within 30 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def frozen(service: RunningService) -> Iterator[None]:
    """The server and every process it started stopped (SIGSTOP) inside the block: their sockets
    stay open and accept connections, nothing answers (a hung host, a stalled disk). SIGCONT
    after. (PostgreSQL's backends run in sessions of their own: they are found as children.)"""
    if service.pid is None:
        raise ServiceUnavailable(f"{service.name} was not started here: it cannot be frozen")
    os.kill(service.pid, signal.SIGSTOP)  # first: it forks no new process while we look
    stopped = [service.pid]
    try:
        for pid in _descendants(service.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextlib.contextmanager
def redis_server(host: str = "127.0.0.1") -> Iterator[RunningService]:
    binary = find_binary("redis-server")
    port = free_port(host)
    data_dir = Path(tempfile.mkdtemp(prefix="kvguard-redis-"))
    argv = [str(binary), "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(data_dir), "--daemonize", "no", "--logfile", str(data_dir / "redis.log")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(proc, "redis-server", host, port)
        yield RunningService("redis", host, port, f"redis://{host}:{port}/0", data_dir, proc.pid)
    finally:
        _stop(proc)
        shutil.rmtree(data_dir, ignore_errors=True)


def _postgres_user() -> str | None:
    """initdb refuses to run as root; run the server as the `postgres` account when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError as exc:
        raise ServiceUnavailable(
            "running as root needs the `postgres` system user (installed with postgresql)"
        ) from exc
    return "postgres"


def _initdb(data_dir: Path, user: str | None) -> None:
    initdb = find_binary("initdb", POSTGRES_BIN_DIRS)
    argv = [str(initdb), "-D", str(data_dir / "pg"), "-U", "postgres", "-A", "trust", "-E", "UTF8"]
    argv += ["--no-sync", "--no-instructions"]
    result = subprocess.run(argv, user=user, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ServiceUnavailable(f"initdb failed: {result.stderr.strip()[-500:]}")


@contextlib.contextmanager
def postgres_server(host: str = "127.0.0.1") -> Iterator[RunningService]:
    user = _postgres_user()
    port = free_port(host)
    data_dir = Path(tempfile.mkdtemp(prefix="kvguard-pg-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    _initdb(data_dir, user)
    postgres = find_binary("postgres", POSTGRES_BIN_DIRS)
    argv = [str(postgres), "-D", str(data_dir / "pg"), "-h", host, "-p", str(port)]
    argv += ["-k", str(data_dir), "-c", "fsync=off", "-c", "full_page_writes=off"]
    argv += ["-c", "synchronous_commit=off", "-c", "max_connections=200"]
    log = open(data_dir / "postgres.log", "wb")  # noqa: SIM115 - closed in finally, after the child
    proc = subprocess.Popen(argv, user=user, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_port(proc, "postgres", host, port)
        _wait_for_postgres_ready(host, port)
        yield RunningService(
            "postgres",
            host,
            port,
            f"postgresql+psycopg://postgres@{host}:{port}/postgres",
            data_dir,
            proc.pid,
        )
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(data_dir, ignore_errors=True)


def _wait_for_postgres_ready(host: str, port: int) -> None:
    import psycopg  # local import: only the PostgreSQL path needs the driver

    deadline = time.monotonic() + 30.0
    while True:
        try:
            with psycopg.connect(host=host, port=port, user="postgres", dbname="postgres"):
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextlib.contextmanager
def prometheus_server(
    config: dict[str, Any], rule_files: dict[str, str] | None = None, host: str = "127.0.0.1"
) -> Iterator[RunningService]:
    """Debian's ``prometheus`` on a free port with ``config`` (a prometheus.yml as a dict).

    ``rule_files`` maps file names to rule YAML written beside the config; the config's
    ``rule_files`` may name them relative to that directory.
    """
    binary = find_binary("prometheus")
    with _yaml_configured("prometheus", config, rule_files or {}) as (data_dir, config_path):
        argv = [str(binary), f"--config.file={config_path}"]
        argv += [f"--storage.tsdb.path={data_dir / 'tsdb'}", "--web.enable-lifecycle"]
        with _http_server("prometheus", argv, data_dir, host) as running:
            yield running


@contextlib.contextmanager
def alertmanager_server(
    config: dict[str, Any], host: str = "127.0.0.1"
) -> Iterator[RunningService]:
    """Alertmanager (Debian's ``prometheus-alertmanager``, upstream's ``alertmanager``) on a free
    port with ``config`` (an alertmanager.yml as a dict), clustering off."""
    try:
        binary = find_binary("prometheus-alertmanager")
    except ServiceUnavailable:
        binary = find_binary("alertmanager")
    with _yaml_configured("alertmanager", config, {}) as (data_dir, config_path):
        argv = [str(binary), f"--config.file={config_path}"]
        argv += [f"--storage.path={data_dir / 'data'}", "--cluster.listen-address="]
        with _http_server("alertmanager", argv, data_dir, host) as running:
            yield running


@contextlib.contextmanager
def _yaml_configured(
    name: str, config: dict[str, Any], extra_files: dict[str, str]
) -> Iterator[tuple[Path, Path]]:
    """A temporary data dir holding ``NAME.yml`` (``config``) and ``extra_files``; removed after."""
    import yaml  # local import: only these servers need YAML

    data_dir = Path(tempfile.mkdtemp(prefix=f"kvguard-{name}-"))
    try:
        for file_name, text in extra_files.items():
            (data_dir / file_name).write_text(text, encoding="utf-8")
        config_path = data_dir / f"{name}.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        yield data_dir, config_path
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


@contextlib.contextmanager
def _http_server(name: str, argv: list[str], data_dir: Path, host: str) -> Iterator[RunningService]:
    """A Prometheus-family server (``--web.listen-address``, ``/-/ready``) on a free port, its
    log in ``data_dir``, stopped at the end."""
    port = free_port(host)
    argv = [*argv, f"--web.listen-address={host}:{port}", "--log.level=warn"]
    log = open(data_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(argv, cwd=data_dir, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{host}:{port}"
    try:
        _wait_for_port(proc, name, host, port)
        _wait_for_http_ok(proc, name, url + "/-/ready")
        yield RunningService(name, host, port, url, data_dir, proc.pid)
    finally:
        _stop(proc)
        log.close()


def _wait_for_http_ok(proc: subprocess.Popen[bytes], name: str, url: str) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceUnavailable(f"{name} exited with status {proc.returncode} during start-up")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=1.0) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.1)
    raise ServiceUnavailable(f"{name} was not ready at {url} within 30 s")
