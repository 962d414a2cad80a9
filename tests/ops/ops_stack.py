"""Real kvguard processes for the operations tests: logs go to files (a full pipe would stall a
role), every process is stopped at the end, start-up failures show the role's log tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvguard.testing import stop_process, wait_for_health

KVGUARD = [sys.executable, "-m", "kvguard"]
REPO = Path(__file__).resolve().parents[2]
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


@dataclass
class Webhook:
    """What an HTTP receiver on 127.0.0.1 was sent: each POST body, parsed as JSON."""

    url: str
    received: list[dict[str, Any]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, check: Any, timeout_s: float) -> dict[str, Any]:
        """The first body ``check`` accepts, waiting for it up to ``timeout_s``."""
        with self.arrived:
            found = self.arrived.wait_for(
                lambda: next((b for b in self.received if check(b)), None), timeout_s
            )
        assert found is not None, f"nothing matching within {timeout_s} s: {self.received}"
        return dict(found)


@contextmanager
def webhook_receiver() -> Iterator[Webhook]:
    """A webhook endpoint (what Alertmanager's webhook_configs call) recording what it gets."""
    hook = Webhook("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with hook.arrived:
                hook.received.append(json.loads(body))
                hook.arrived.notify_all()
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hook.url = f"http://127.0.0.1:{server.server_address[1]}/alerts"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hook
    finally:
        server.shutdown()
        server.server_close()


def completed_alertmanager_config(webhook: str) -> dict[str, Any]:
    """The committed deploy/alertmanager.yml as a user completes it (step 2 of the operations
    walk-through): a webhook on the ``kvguard`` receiver, nothing else changed."""
    config = yaml.safe_load((REPO / "deploy" / "alertmanager.yml").read_text())
    (receiver,) = [r for r in config["receivers"] if r["name"] == "kvguard"]
    receiver["webhook_configs"] = [{"url": webhook, "send_resolved": True}]
    return dict(config)
