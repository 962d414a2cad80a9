"""What floods of API keys cost a legitimate tenant (issue 32, finding 3).

Run: ``python -m bench.bench_auth_flood`` (``--help`` for options). One ``kvguard gateway``
process on a private PostgreSQL; a legitimate tenant sends ``GET /v1/models`` one request after
another (its key verified, then cached) and its latency is measured side by side in one run:

- ``baseline``: nothing else;
- ``ordinary traffic``: the flood's shape with a valid key (what serving that many requests costs
  the machine at all: the control for the next row);
- ``unknown-key flood``: ``--connections`` connections, each from its own loopback address
  (127.1.x.y: so no per-address throttle can stop them all), each sending a fresh well-formed
  unknown key every ``--pause`` seconds (a database lookup each, unless the gateway avoids it);
- ``tenant burst``: another tenant opens ``--connections`` connections at once with one key the
  gateway has not seen yet (a cold cache), one request each.

Prints per scenario: the legitimate tenant's median and p90 (ms), the ratio of its median to the
baseline's, the legitimate tenant's and the burster's 503s, and what the flood got. Goals (issue
32): the median within 2x the baseline under the flood; no tenant sees a 503. The flooding
clients run in their own process (they share the machine's cores with the gateway: on a small
machine the flood's own CPU is part of what is measured).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import secrets
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from bench.summary import emit
from kvguard.localservices import free_port, postgres_server

GOAL_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class Row:
    scenario: str
    median_ms: float
    p90_ms: float
    legit_503: int
    other_503: int
    other: str  # what the flooding / bursting side got, by status


def unknown_key() -> str:
    return f"kvg_{secrets.token_hex(6)}_{secrets.token_hex(32)}"


def address(n: int) -> str:
    return f"127.1.{n // 250}.{n % 250 + 1}"


async def _flood(
    url: str, connections: int, pause_s: float, seconds: float, key: str | None
) -> Counter[int]:
    statuses: Counter[int] = Counter()
    tls = ssl.create_default_context()  # one for all: each of its own costs ~10 ms to make
    clients = [
        httpx.AsyncClient(
            base_url=url,
            transport=httpx.AsyncHTTPTransport(local_address=address(n), verify=tls),
            timeout=30,
        )
        for n in range(connections)
    ]
    deadline = time.monotonic() + seconds

    async def one(n: int, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(pause_s * n / connections)  # spread the first requests
        while time.monotonic() < deadline:
            try:
                token = key or unknown_key()
                r = await client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
                statuses[r.status_code] += 1
            except httpx.HTTPError:
                statuses[0] += 1
            await asyncio.sleep(pause_s)

    try:
        await asyncio.gather(*(one(n, c) for n, c in enumerate(clients)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return statuses


def flood_process(
    url: str, connections: int, pause_s: float, seconds: float, key: str | None, out: object
) -> None:
    statuses = asyncio.run(_flood(url, connections, pause_s, seconds, key))
    out.put(dict(statuses))  # type: ignore[attr-defined]


async def _burst(url: str, key: str, connections: int) -> Counter[int]:
    limits = httpx.Limits(max_connections=connections)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one() -> int:
            try:
                r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                return r.status_code
            except httpx.HTTPError:
                return 0

        return Counter(await asyncio.gather(*(one() for _ in range(connections))))


def burst_process(url: str, key: str, connections: int, out: object) -> None:
    out.put(dict(asyncio.run(_burst(url, key, connections))))  # type: ignore[attr-defined]


def legit_latencies(url: str, key: str, seconds: float) -> tuple[list[float], int]:
    """(latencies in ms, 503s) of one tenant's sequential requests for ``seconds``."""
    latencies: list[float] = []
    unavailable = 0
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            r = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            latencies.append((time.perf_counter() - start) * 1000)
            unavailable += r.status_code == 503
            time.sleep(0.02)
    return latencies, unavailable


def row(scenario: str, latencies: list[float], legit_503: int, other: dict[int, int]) -> Row:
    ordered = sorted(latencies)
    return Row(
        scenario=scenario,
        median_ms=statistics.median(ordered),
        p90_ms=ordered[int(0.9 * (len(ordered) - 1))],
        legit_503=legit_503,
        other_503=other.get(503, 0),
        other=", ".join(f"{k or 'error'}: {v}" for k, v in sorted(other.items())),
    )


def start_gateway(database_url: str, data_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    env |= {"KVGUARD_DATABASE_URL": database_url, "KVGUARD_DATA_DIR": data_dir}
    argv = [sys.executable, "-m", "kvguard", "gateway", "--port", str(port), "--log-level", "error"]
    proc = subprocess.Popen(argv, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(url + "/health", timeout=2)  # any answer: serving (no engine: 503)
            return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.2)


def create_key(url: str, name: str) -> str:
    r = httpx.post(
        url + "/admin/tenants",
        json={"name": name},
        headers={"Authorization": "Bearer kvguard-dev-admin-token"},
        timeout=30,
    )
    r.raise_for_status()
    return str(r.json()["key"]["key"])


def run(connections: int, pause_s: float, seconds: float) -> list[Row]:
    ctx = multiprocessing.get_context("spawn")
    with postgres_server() as pg, tempfile.TemporaryDirectory() as data_dir:
        proc, url = start_gateway(pg.url, data_dir)
        try:
            key = create_key(url, "legit")
            legit_latencies(url, key, 1.0)  # warm: the key verified and cached
            base, base_503 = legit_latencies(url, key, seconds)
            rows = [row("baseline", base, base_503, {})]
            out = ctx.Queue()
            control_key = create_key(url, "ordinary")
            for scenario, flood_key in (
                ("ordinary traffic", control_key),
                ("unknown-key flood", None),
            ):
                flood = ctx.Process(
                    target=flood_process,
                    args=(url, connections, pause_s, seconds + 2, flood_key, out),
                    daemon=True,
                )
                flood.start()
                time.sleep(1.0)  # the flood under way
                flooded, flooded_503 = legit_latencies(url, key, seconds)
                flood.join()
                rows.append(row(scenario, flooded, flooded_503, out.get()))
            burst_key = create_key(url, "bursting")
            burst = ctx.Process(
                target=burst_process, args=(url, burst_key, connections, out), daemon=True
            )
            burst.start()
            during, during_503 = legit_latencies(url, key, 2.0)
            burst.join()
            rows.append(row("tenant burst", during, during_503, out.get()))
            return rows
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def print_table(rows: Sequence[Row], baseline: float) -> None:
    head = (
        f"{'scenario':<20}{'median ms':>10}{'p90 ms':>9}{'x base':>8}{'legit 503':>10}"
        f"{'other 503':>10}  other side (status: requests)"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.scenario:<20}{r.median_ms:>10.1f}{r.p90_ms:>9.1f}{r.median_ms / baseline:>7.2f}x"
            f"{r.legit_503:>10}{r.other_503:>10}  {r.other}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument(
        "--pause", type=float, default=2.0, help="seconds between a flooding connection's requests"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="per measured scenario")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the gateway and PostgreSQL too
    rows = run(args.connections, args.pause, args.seconds)
    baseline = rows[0].median_ms
    print_table(rows, baseline)
    control, flood, burst = rows[1], rows[2], rows[3]
    ratio = flood.median_ms / baseline
    emit(
        "auth_flood",
        f"legit tenant median under {args.connections} unknown-key connections / baseline",
        f"{ratio:.2f}x ({flood.median_ms:.1f} vs {baseline:.1f} ms)",
        f"< {GOAL_RATIO:g}x",
        ratio < GOAL_RATIO,
    )
    emit(
        "auth_flood",
        f"legit tenant median: {args.connections} unknown-key connections / as many with a valid "
        "key at the same rate",
        f"{flood.median_ms / control.median_ms:.2f}x",
    )
    failures = flood.legit_503 + burst.legit_503 + burst.other_503 + control.legit_503
    emit(
        "auth_flood",
        f"503s seen by tenants (legit under the flood and a burst; the {args.connections}-"
        "connection bursting tenant)",
        str(failures),
        "0",
        failures == 0,
    )
    print(
        f"\ncommand: python -m bench.bench_auth_flood --connections {args.connections} "
        f"--pause {args.pause:g} --seconds {args.seconds:g}"
    )
    return 0 if ratio < GOAL_RATIO and failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
