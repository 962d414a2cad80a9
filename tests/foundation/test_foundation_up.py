"""`kvguard up` brings the embedded stack up, and the key and URL it prints really work."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvguard.localservices import free_port
from kvguard.testing import interruptible


def test_up_prints_a_working_key_and_stops_cleanly(tiny_checkpoint: str, tmp_path: Path) -> None:
    port, backend_port = free_port(), free_port()
    env = {
        **os.environ,
        "KVGUARD_MODEL": tiny_checkpoint,
        "KVGUARD_SERVED_MODEL_NAME": "kvguard-tiny",
        "KVGUARD_TORCH_THREADS": "1",
    }
    argv = [sys.executable, "-m", "kvguard", "up", "--port", str(port)]
    argv += ["--backend-port", str(backend_port), "--data-dir", str(tmp_path / "data")]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=interruptible,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 240
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Press Ctrl-C" in line or time.monotonic() > deadline:
                break
        output = "".join(lines)
        assert "all roles healthy" in output, output
        key = re.search(r"API key \(shown once\): (\S+)", output)
        assert key is not None, output
        assert f"http://127.0.0.1:{port}/v1/chat/completions" in output
        body = {
            "model": "kvguard-tiny",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Repeat exactly: hello kvguard"}],
        }
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        ok = httpx.post(
            url, json=body, headers={"Authorization": f"Bearer {key.group(1)}"}, timeout=60
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["role"] == "assistant"
        denied = httpx.post(url, json=body, headers={"Authorization": "Bearer kvg_bad"}, timeout=60)
        assert denied.status_code == 401
        capacity_url = f"http://127.0.0.1:{backend_port}/engine/capacity"
        assert httpx.get(capacity_url, timeout=10).status_code == 401  # the gateway's alone
        token = re.search(r"Authorization: Bearer (\S+)' \\\n", output)
        assert token is not None, output
        engine_auth = {"Authorization": f"Bearer {token.group(1)}"}
        capacity = httpx.get(capacity_url, headers=engine_auth, timeout=10)
        assert capacity.json()["role"] == "unified"
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, rest
    assert "stopping" in rest
