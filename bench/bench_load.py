"""Long-context Locust run through the gateway: tokens/s and TTFT at the near-limit size.

    .venv/bin/python -m bench.bench_load [--quick] [--users N] [--duration S] [--window TOKENS]

Starts the bundled engine (``kvguard backend unified``, the given context window) and the
gateway (SQLite, canary firewall on) on 127.0.0.1, then runs ``kvguard load``'s near-limit size
only (every prompt + max_tokens equals the enforced limit; each request asks for its own marker
back and is checked for it) and prints output tokens/s and TTFT p50/p99, with the content-check
failures, which must be 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.summary import emit
from canary.config import CanarySettings
from canary.markers import MarkerCodec
from kvguard.load.runner import bench_long_context
from kvguard.localservices import free_port
from kvguard.testing import EngineProcess

BUNDLED = Path(__file__).resolve().parents[1] / "backend" / "bundled" / "kvguard-tiny"
ADMIN_TOKEN = "bench-load-admin-token-0123456789abcdef"
CANARY_KEY = "bench-load-canary-key-0123456789abcdef0123"


def _wait_routable(url: str, gateway: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    while time.monotonic() < deadline:
        if gateway.poll() is not None:
            raise RuntimeError(f"gateway exited: {log.read_text()[-3000:]}")
        try:
            engines = httpx.get(url + "/admin/engines", headers=headers, timeout=2).json()
            if any(e.get("routable") for e in engines):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"gateway never routed to the engine: {log.read_text()[-3000:]}")


def run(users: int, duration_s: float, window: int, tmp: Path) -> dict[str, object]:
    env = {
        **os.environ,
        "KVGUARD_DATA_DIR": str(tmp / "data"),
        "KVGUARD_ADMIN_TOKEN": ADMIN_TOKEN,
        "KVGUARD_CANARY_KEY": CANARY_KEY,
        "GLOG_minloglevel": "2",
    }
    engine_port, port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvguard", "backend", "unified", "--port", str(engine_port)]
    argv += ["--model", str(BUNDLED), "--pool-tokens", str(4 * window)]
    argv += ["--context-window", str(window)]
    engine = EngineProcess(argv, f"http://127.0.0.1:{engine_port}", env)
    log = tmp / "gateway.log"
    gateway: subprocess.Popen[bytes] | None = None
    try:
        engine.wait_healthy()
        gateway_argv = [sys.executable, "-m", "kvguard", "gateway", "--port", str(port)]
        gateway_argv += ["--log-level", "warning", "--engine", engine.url]
        with log.open("wb") as out:
            gateway = subprocess.Popen(gateway_argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        _wait_routable(url, gateway, log)
        codec = MarkerCodec(CanarySettings(canary_key=CANARY_KEY).keyring())  # the gateway's key
        return bench_long_context(
            url, tmp / "load", codec=codec, admin_token=ADMIN_TOKEN, users=users,
            duration_s=duration_s,
        )  # fmt: skip
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(20)
        engine.stop()


def _ttft(p50: object, p99: object) -> str:
    """TTFT p50 / p99, or what stands in for them when no answer brought a first token (every
    answer failed or was empty: the content-check failures say why, and the run fails on them)."""
    if not isinstance(p50, int | float) or not isinstance(p99, int | float):
        return "none: no answer streamed any text"
    return f"{p50:.0f} / {p99:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 users, 20 s, 1,024-token window")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--window", type=int, default=4096, help="engine context window, tokens")
    args = parser.parse_args(argv)
    users, duration, window = (
        (2, 20.0, 1024) if args.quick else (args.users, args.duration, args.window)
    )
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-load-") as tmp:
        result = run(users, duration, window, Path(tmp))
    print(f"{users} users, {duration:.0f} s, window {window} tokens (near-limit prompts only)")
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    size = f"prompt {result['prompt_tokens']} of {result['max_model_len']} tokens, {users} users"
    emit(
        "load", f"output tok/s through the gateway, {size}", f"{result['output_tokens_per_s']:.1f}"
    )
    ttft = _ttft(result["ttft_p50_ms"], result["ttft_p99_ms"])
    emit("load", f"TTFT p50 / p99 at the near-limit size, {size}", ttft)
    failures = int(str(result["content_check_failures"])) + int(str(result["unexpected_statuses"]))
    emit("load", "content-check failures + unexpected statuses", str(failures), "0", failures == 0)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
