"""Start prefill/decode/unified processes in parallel, talk to them, read their metrics.

Processes write their logs to a file (a pipe nobody reads could fill up and block them). Every
helper has a deadline; nothing here waits forever.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from backend.bundled import chat as chat_format
from kvguard.localservices import free_port
from kvguard.testing import stop_process, wait_for, wait_for_health

MODEL = "tiny-llama"
PAGE = 16


@dataclass
class Role:
    role: str
    options: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, model: str) -> None:
        argv = [sys.executable, "-m", "kvguard", "backend", self.role, "--port", str(self.port)]
        argv += ["--model", model]
        for key, value in self.options.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not None and value is not False:
                argv += [flag, str(value)]
        env = {
            **os.environ,
            "KVGUARD_TORCH_THREADS": "1",
            "KVGUARD_SERVED_MODEL_NAME": MODEL,
            "GLOG_minloglevel": "2",
            **self.env,
        }
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvguard-{self.role}-", suffix=".log")
        self.proc = subprocess.Popen(argv, env=env, stdout=fd, stderr=subprocess.STDOUT)
        os.close(fd)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        assert self.proc is not None
        wait_for_health(
            self.proc, self.url, self.role, self.log, timeout_s, expect={"role": self.role}
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10.0)
        if self.log_path and os.path.exists(self.log_path):
            os.unlink(self.log_path)


def prefill(env: dict[str, str] | None = None, **options: Any) -> Role:
    return Role("prefill", {"page_size": PAGE, **options}, env or {})


def decode(of: Role, env: dict[str, str] | None = None, **options: Any) -> Role:
    return Role("decode", {"page_size": PAGE, "prefill_url": of.url, **options}, env or {})


def faults(*names: str) -> dict[str, str]:
    return {"KVGUARD_FAULTS": json.dumps(list(names))}


@contextmanager
def running(model: str, *roles: Role) -> Iterator[None]:
    """Spawn every role at once (they load in parallel), wait for all, stop all at the end."""
    try:
        for role in roles:
            role.spawn(model)
        for role in roles:
            role.wait_healthy()
        for role in roles:
            if role.role == "decode":
                wait_for(lambda r=role: capacity(r)["unavailable"] is None, 30, "path ready")
        yield
    finally:
        for role in roles:
            role.stop()


def capacity(role: Role) -> dict[str, Any]:
    return httpx.get(role.url + "/engine/capacity", timeout=10).json()


def kv_reads(decode_role: Role) -> dict[str, dict[str, Any]]:
    reads = httpx.get(decode_role.url + "/engine/drill/kv-reads", timeout=10).json()["reads"]
    return {entry["request_id"]: entry for entry in reads}


def metric(role: Role, name: str, **labels: str) -> float:
    """The value of one sample of ``name`` (0 if absent) from the role's /metrics."""
    text = httpx.get(role.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        base, _, rest = sample.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if base == name and got == want:
            return float(value)
    return 0.0


def complete(
    role: Role, prompt: str, *, max_tokens: int, request_id: str, tenant: str = "tenant-a"
) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    headers = {"X-Kvguard-Request-Id": request_id, "X-Kvguard-Tenant": tenant}
    return httpx.post(role.url + "/v1/completions", json=body, headers=headers, timeout=60)


def chat(
    role: Role,
    messages: list[dict[str, str]],
    *,
    max_tokens: int,
    request_id: str,
    tenant: str = "tenant-a",
) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    headers = {"X-Kvguard-Request-Id": request_id, "X-Kvguard-Tenant": tenant}
    return httpx.post(role.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def chat_tokens(messages: list[dict[str, str]]) -> int:
    """Prompt tokens of ``messages`` as the engine renders them (byte tokenizer, BOS included)."""
    return len(chat_format.render(messages).encode()) + 1


def prompt_of(n_tokens: int, fill: str = "a") -> str:
    """A prompt of exactly ``n_tokens`` tokens with the byte tokenizer (BOS + bytes)."""
    return fill * (n_tokens - 1)
