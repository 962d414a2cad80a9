"""Load tools shared by the gateway benchmarks (``bench_gateway``, ``bench_proxy``).

An open-loop sender (``open_loop``: fixed send times, so a slow answer does not slow the sender;
aiohttp, whose own CPU per request is a quarter of httpx's, since it shares the cores with what
it measures), its ``Result`` and ``pooled`` rounds, percentiles, a process's CPU time from
``/proc``, and starting a gateway process and a limited tenant the way an operator would.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from kvguard.localservices import free_port


@dataclass(frozen=True)
class Result:
    path: str
    rate: int
    sent: int
    errors: int
    achieved: float
    p50_ms: float
    p99_ms: float
    cpu_s: float | None = None  # the measured process's CPU seconds over the load (after warm-up)
    samples: tuple[float, ...] = field(default=(), repr=False)  # latencies (ms) of the 200s


def pooled(parts: list[Result]) -> Result:
    """One path's rounds as one result: percentiles over every round's samples together."""
    samples = [ms for part in parts for ms in part.samples]
    cpu = [part.cpu_s for part in parts if part.cpu_s is not None]
    return Result(
        parts[0].path,
        parts[0].rate,
        sum(part.sent for part in parts),
        sum(part.errors for part in parts),
        statistics.fmean(part.achieved for part in parts),
        statistics.median(samples) if samples else float("nan"),
        percentile(samples, 0.99) if samples else float("nan"),
        sum(cpu) if cpu else None,
        tuple(samples),
    )


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def open_loop(
    url: str,
    headers: dict[str, str],
    body: dict,
    rate: int,
    seconds: float,
    path: str,
    cpu_pid: int | None = None,
) -> Result:
    """Send ``rate`` requests/s for ``seconds`` on a fixed schedule; latency of each 200.

    The load generator is aiohttp (a quarter of httpx's CPU per request, ``bench_http_client``):
    it shares the two cores with the engine and the gateway, so its own cost is kept small.
    """
    latencies: list[float] = []
    errors = 0
    data = json.dumps(body).encode()
    send_headers = {**headers, "Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=512)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def post() -> bool:
            async with session.post(url, data=data, headers=send_headers) as response:
                await response.read()
                return response.status == 200

        for _ in range(20):  # warm connections and code paths
            await post()

        async def one(at: float) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            started = time.perf_counter()
            try:
                ok = await post()
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                latencies.append((time.perf_counter() - started) * 1000)
            else:
                errors += 1

        cpu_before = process_cpu_s(cpu_pid) if cpu_pid is not None else None
        start = time.perf_counter() + 0.05
        count = int(rate * seconds)
        await asyncio.gather(*(one(start + i / rate) for i in range(count)))
        took = time.perf_counter() - start
        cpu = None if cpu_pid is None else process_cpu_s(cpu_pid) - (cpu_before or 0.0)
    return Result(
        path,
        rate,
        count,
        errors,
        len(latencies) / took,
        statistics.median(latencies) if latencies else float("nan"),
        percentile(latencies, 0.99) if latencies else float("nan"),
        cpu,
        tuple(latencies),
    )


def start_gateway(
    engine_url: str, model: str, env: dict[str, str], log: Path, *, litellm: bool = True
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
    engines = [litellm_engine] if litellm else []
    gateway_env = {**env, "KVGUARD_ENGINES": json.dumps(engines)}
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
