"""Real kvguard processes for the operations tests: logs go to files (a full pipe would stall a
role), every process is stopped at the end, start-up failures show the role's log tail."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvguard.testing import stop_process, wait_for_health

KVGUARD = [sys.executable, "-m", "kvguard"]
MODEL_NAME = "kvguard-tiny"


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> Proc:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=out)
        return self

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        assert self.proc is not None
        wait_for_health(self.proc, self.url, self.name, self.tail, timeout_s)

    def stop(self) -> None:
        stop_process(self.proc)


def base_env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "KVGUARD_TORCH_THREADS": "1",
        "KVGUARD_SERVED_MODEL_NAME": MODEL_NAME,
        "GLOG_minloglevel": "2",
        **extra,
    }


def kvguard_proc(name: str, args: list[str], env: dict[str, str], log_dir: Path, url: str) -> Proc:
    return Proc(name, [*KVGUARD, *args], env, log_dir / f"{name}.log", url)


@contextmanager
def running(*procs: Proc) -> Iterator[None]:
    """Start all at once (they load in parallel), wait for each, stop all at the end."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy()
        yield
    finally:
        for p in reversed(procs):
            p.stop()


def admin(env: dict[str, str], *args: str) -> str:
    """``kvguard admin ...``; returns the last line of its output (a key for create commands)."""
    done = subprocess.run([*KVGUARD, "admin", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def chat(gateway: str, key: str, content: str, **extra: Any) -> httpx.Response:
    body = {
        "model": MODEL_NAME,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(gateway + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def prom_query(prometheus: str, expr: str) -> dict[str, Any]:
    response = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    return dict(response.json())
