"""A small process supervisor for `kvguard up`.

Lifecycle: start each role in order -> wait for its health check (a role that exits or never
becomes healthy aborts the start-up) -> print which role is on which port -> watch -> on Ctrl-C,
SIGTERM, any role exiting, or any role reporting itself failed: stop every role (SIGTERM, then
SIGKILL after a grace period), in reverse start order. A role reports itself failed when its
health check answers ``"status": "failed"``, a state it never leaves (an engine whose loop failed,
a gateway whose background task ended); it is asked every ``health_every_s``. Nothing is
restarted silently: a role that dies or fails ends the whole stack with a non-zero status naming
that role and, for a failure, what it said.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO


@dataclass(frozen=True, slots=True)
class RoleSpec:
    """One role. ``url`` is where it listens (or, for a role without an HTTP server, what it
    calls); such a role names a ``heartbeat`` file instead, and is healthy once that exists."""

    name: str
    argv: list[str]
    url: str
    health_path: str = "/health"
    env: dict[str, str] | None = None
    startup_timeout_s: float = 180.0
    heartbeat: Path | None = None


@dataclass(slots=True)
class _Running:
    spec: RoleSpec
    proc: subprocess.Popen[bytes]


class RoleFailed(RuntimeError):
    def __init__(self, role: str, detail: str) -> None:
        super().__init__(f"role '{role}' {detail}")
        self.role = role


class _Stop(Exception):
    """Raised from the signal handler to leave the watch loop."""


@dataclass(slots=True)
class Supervisor:
    roles: Sequence[RoleSpec]
    out: TextIO = sys.stdout
    grace_s: float = 10.0
    health_every_s: float = 5.0
    _running: list[_Running] = field(default_factory=list)

    def run(self, banner: str | Callable[[], str] = "") -> int:
        """Start everything, watch, stop everything. Returns the process exit status.

        ``banner`` may be a callable run once every role is healthy (e.g. to issue a demo key);
        if it raises, the stack is stopped and the status is non-zero.
        """
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_stop) if in_main else None
        try:
            self.start()
            self._print_table(banner() if callable(banner) else banner)
            return self.watch()
        except RoleFailed as exc:
            print(f"kvguard up: {exc}; stopping the other roles", file=self.out, flush=True)
            return 1
        except RuntimeError as exc:
            print(f"kvguard up: {exc}; stopping", file=self.out, flush=True)
            return 1
        except (KeyboardInterrupt, _Stop):
            print("kvguard up: stopping", file=self.out, flush=True)
            return 0
        finally:
            self.stop()
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    def start(self) -> None:
        for spec in self.roles:
            print(f"kvguard up: starting {spec.name} ...", file=self.out, flush=True)
            proc = subprocess.Popen(spec.argv, env=spec.env)
            running = _Running(spec, proc)
            self._running.append(running)
            self._wait_healthy(running)

    def watch(self, poll_s: float = 0.5) -> int:
        asked = time.monotonic()
        while True:
            for running in self._running:
                code = running.proc.poll()
                if code is not None:
                    raise RoleFailed(running.spec.name, f"exited with status {code}")
            if time.monotonic() - asked >= self.health_every_s:
                for running in self._running:
                    spec = running.spec
                    said = None if spec.heartbeat else _failed(spec.url + spec.health_path)
                    if said is not None:
                        raise RoleFailed(spec.name, f"reports itself failed: {said}")
                asked = time.monotonic()
            time.sleep(min(poll_s, self.health_every_s))

    def stop(self) -> None:
        for running in reversed(self._running):
            if running.proc.poll() is None:
                running.proc.terminate()
        deadline = time.monotonic() + self.grace_s
        for running in reversed(self._running):
            try:
                running.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running.proc.kill()
                running.proc.wait()
        self._running.clear()

    def _wait_healthy(self, running: _Running) -> None:
        spec = running.spec
        deadline = time.monotonic() + spec.startup_timeout_s
        while time.monotonic() < deadline:
            code = running.proc.poll()
            if code is not None:
                raise RoleFailed(spec.name, f"exited with status {code} during start-up")
            if spec.heartbeat.exists() if spec.heartbeat else _healthy(spec.url + spec.health_path):
                return
            time.sleep(0.2)
        raise RoleFailed(spec.name, f"was not healthy within {spec.startup_timeout_s:.0f} s")

    def _print_table(self, banner: str) -> None:
        width = max(len(r.spec.name) for r in self._running) if self._running else 4
        lines = ["", "kvguard up: all roles healthy", ""]
        lines += [
            f"  {r.spec.name:<{width}}  {r.spec.url}  (pid {r.proc.pid})" for r in self._running
        ]
        lines += ["", banner, "Press Ctrl-C to stop."] if banner else ["", "Press Ctrl-C to stop."]
        print("\n".join(lines), file=self.out, flush=True)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _failed(url: str) -> str | None:
    """What a role whose health check answers ``"status": "failed"`` says (its ``error``, or its
    ``problems``); None for any other answer, or none (an exit is seen by the poll)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            raw = response.read(65536)
    except urllib.error.HTTPError as error:
        raw = error.read(65536)
    except (urllib.error.URLError, OSError):
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("status") != "failed":
        return None
    said = body.get("error") or "; ".join(map(str, body.get("problems") or [])) or "no detail"
    return str(said)[:300]


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop()
