"""Gateway-added latency: the same open-loop load sent straight to the engine and through the
gateway (API key auth, Redis limits, exact token count, capacity check all on).

Run: ``python -m bench.bench_gateway`` (``--help`` for options). It starts a private Redis, the
real engine (``kvguard backend unified`` on a small random byte-level checkpoint) and the
gateway (``kvguard gateway``) as processes, creates a limited tenant, then for each rate sends
``--seconds`` of requests at fixed intervals (open loop: a slow answer does not slow the
sender) and prints p50/p99 latency per path, and what the gateway adds over calling the engine
directly at the same rate. Paths:

- ``direct``: client -> engine.
- ``gateway``: client -> gateway (direct httpx upstream) -> engine.
- ``gateway+litellm``: the same engine registered as a litellm provider (``openai/<model>``),
  i.e. the gateway calling ``litellm.acompletion``: litellm's per-request overhead in-process.

The LiteLLM *proxy* is not measured side by side: ``litellm[proxy]`` needs the separate
``litellm-proxy`` distribution, which the package index this project installs from does not
have; the row says so instead of inventing a number.

Goal: the gateway adds under 5 ms at p99 at 100 requests/s. Exit status 1 if missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvguard.localservices import free_port, redis_server
from kvguard.testing import EngineProcess, launch_engine, write_tiny_checkpoint

GOAL_ADDED_P99_MS = 5.0
GOAL_RATE = 100


@dataclass(frozen=True)
class Result:
    path: str
    rate: int
    sent: int
    errors: int
    achieved: float
    p50_ms: float
    p99_ms: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def open_loop(
    url: str, headers: dict[str, str], body: dict, rate: int, seconds: float, path: str
) -> Result:
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        for _ in range(20):  # warm connections and code paths
            await client.post(url, json=body, headers=headers)

        async def one(at: float) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            started = time.perf_counter()
            try:
                response = await client.post(url, json=body, headers=headers)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append((time.perf_counter() - started) * 1000)
            else:
                errors += 1

        start = time.perf_counter() + 0.05
        count = int(rate * seconds)
        await asyncio.gather(*(one(start + i / rate) for i in range(count)))
        took = time.perf_counter() - start
    return Result(
        path,
        rate,
        count,
        errors,
        len(latencies) / took,
        statistics.median(latencies) if latencies else float("nan"),
        percentile(latencies, 0.99) if latencies else float("nan"),
    )


def start_gateway(
    engine_url: str, model: str, env: dict[str, str], log: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    litellm_engine = {
        "name": "via-litellm",
        "kind": "litellm",
        "base_url": f"{engine_url}/v1",
        "model": "bench-litellm",
        "litellm_model": f"openai/{model}",
        "declared_max_model_len": 2048,
        "allow_unverified": True,
    }
    gateway_env = {**env, "KVGUARD_ENGINES": json.dumps([litellm_engine])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvguard",
            "gateway",
            "--port",
            str(port),
            "--engine",
            engine_url,
            "--log-level",
            "warning",
        ],
        env=gateway_env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("gateway did not become healthy")


def create_tenant(env: dict[str, str]) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvguard",
            "admin",
            "tenant",
            "create",
            "bench",
            "--rpm",
            "1000000",
            "--tpm",
            "100000000",
            "--concurrency",
            "10000",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def table(results: list[Result]) -> str:
    direct = {r.rate: r for r in results if r.path == "direct"}
    lines = [
        "| path | rate/s | achieved/s | errors | p50 ms | p99 ms | added p50 ms | added p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = direct.get(r.rate)
        added = (
            ("-", "-")
            if r.path == "direct" or base is None
            else (f"{r.p50_ms - base.p50_ms:.2f}", f"{r.p99_ms - base.p99_ms:.2f}")
        )
        lines.append(
            f"| {r.path} | {r.rate} | {r.achieved:.0f} | {r.errors} | {r.p50_ms:.2f} | "
            f"{r.p99_ms:.2f} | {added[0]} | {added[1]} |"
        )
    for rate in sorted(direct):
        lines.append(
            f"| litellm proxy | {rate} | not measured: litellm[proxy] is not installable "
            "here (no litellm-proxy distribution) | | | | | |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace, engine: EngineProcess, env: dict[str, str]) -> int:
    model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    key = create_tenant(env)
    log = Path(env["KVGUARD_DATA_DIR"]) / "gateway.log"
    gateway, gateway_url = start_gateway(engine.url, model, env, log)
    try:
        body = {"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0}
        auth = {"Authorization": f"Bearer {key}"}
        results = []
        for rate in args.rates:
            results.append(
                await open_loop(
                    f"{engine.url}/v1/completions", {}, body, rate, args.seconds, "direct"
                )
            )
            results.append(
                await open_loop(
                    f"{gateway_url}/v1/completions", auth, body, rate, args.seconds, "gateway"
                )
            )
            if not args.skip_litellm:
                results.append(
                    await open_loop(
                        f"{gateway_url}/v1/completions",
                        auth,
                        {**body, "model": "bench-litellm"},
                        rate,
                        args.seconds,
                        "gateway+litellm",
                    )
                )
    finally:
        gateway.terminate()
        gateway.wait(timeout=15)
    print(table(results))
    at_goal = [r for r in results if r.path == "gateway" and r.rate == GOAL_RATE]
    direct = {r.rate: r for r in results if r.path == "direct"}
    if not at_goal:
        print(f"\ngoal not evaluated (no run at {GOAL_RATE}/s)")
        return 0
    added = at_goal[0].p99_ms - direct[GOAL_RATE].p99_ms
    verdict = "met" if added < GOAL_ADDED_P99_MS and at_goal[0].errors == 0 else "MISSED"
    print(
        f"\ngoal: gateway adds < {GOAL_ADDED_P99_MS} ms p99 at {GOAL_RATE}/s: {verdict} "
        f"(added p99 {added:.2f} ms)"
    )
    return 0 if verdict == "met" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=int, nargs="+", default=[25, 50, 100])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--skip-litellm", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, redis_server() as redis:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "ckpt")
        env = {
            **os.environ,
            "KVGUARD_DATABASE_URL": f"sqlite:///{tmp}/gateway.db",
            "KVGUARD_DATA_DIR": tmp,
            "KVGUARD_REDIS_URL": redis.url,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_OFFLINE_MODE": "true",
        }
        engine = launch_engine(checkpoint, pool_tokens=8192, context_window=2048)
        try:
            return asyncio.run(run(args, engine, env))
        finally:
            engine.stop()


if __name__ == "__main__":
    sys.exit(main())
