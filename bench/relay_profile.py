"""Where the gateway's CPU goes: py-spy samples of ``kvguard gateway`` under the relay benchmark's
load, summed by area and by function.

Run: ``python -m bench.relay_profile [--seconds 15] [--out bench/results/relay-profile.md]``.
It starts what ``bench.bench_relay`` starts for the gateway (stand-in, Redis, PostgreSQL, 10
tenants, the canary marking 10%), then for non-streaming and for streaming requests (64-token
answers) keeps the gateway busy with a closed loop of clients (``CLIENTS``) while ``py-spy record
--nonblocking`` samples every thread of it. Samples of worker threads waiting (for work, for the
database) are dropped; what is left is where the process computes, including the event loop's own
C code (uvloop: socket reads and writes, epoll), which has no Python frame. py-spy comes with the
``bench`` extra.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import uvloop

from bench import relay_report
from bench.relay_load import Driver
from bench.relay_systems import Relay, Systems, create_tenants, pin_self

RESULTS = Path(__file__).resolve().parent / "results" / "relay-profile.md"
# closed-loop clients: enough to keep the gateway's core busy (a stream lasts 0.64 s)
CLIENTS = {False: 16, True: 128}
# (area, substrings of a frame's "function (file:line)" text): a sample counts for every area
# one of its frames matches
AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("uvicorn HTTP protocol (httptools)", ("uvicorn/protocols/http",)),
    (
        "data plane door, server, replies (proxy/door.py, server.py, reply.py)",
        ("proxy/door.py", "proxy/server.py", "proxy/reply.py"),
    ),
    ("data plane pump (proxy/stream.py)", ("proxy/stream.py",)),
    (
        "the request's flight (gateway/proxy/service.py: its life, the per-event loop)",
        ("proxy/service.py",),
    ),
    ("starlette/fastapi (routing, middleware, responses)", ("starlette/", "fastapi/")),
    ("pydantic validation", ("pydantic/", "pydantic_core")),
    ("kvguard body guard middleware", ("contracts/http_edge.py",)),
    ("auth (key lookup, cache)", ("gateway/deps.py", "services/keys.py", "auth_cache.py")),
    ("admission (route, count, fit)", ("proxy/admission.py", "bundled/chat.py")),
    ("limiter (Redis)", ("gateway/limits/", "redis/")),
    ("canary injection", ("canary/injection.py", "canary/markers.py")),
    ("SSE split (contracts/sse.py)", ("contracts/sse.py",)),
    ("JSON (orjson)", ("orjson",)),
    ("JSON (stdlib json)", ("json/",)),
    ("relay: StreamRelay/relay_body", ("proxy/relay.py", "proxy/body.py", "proxy/chunks.py")),
    ("relay: side-field screening", ("proxy/side.py", "proxy/side_fields.py")),
    ("leak firewall + scanner", ("canary/firewall.py", "canary/scanner.py")),
    ("engine client (upstream/wire.py, direct.py)", ("upstream/wire.py", "upstream/direct.py")),
    ("finish + audit record", ("proxy/finish.py", "services/audit.py")),
    ("audit flush / DB (SQLAlchemy, psycopg)", ("sqlalchemy/", "psycopg")),
    (
        "metrics (prometheus_client, gateway/proxy/latency.py)",
        ("prometheus_client/", "proxy/latency.py"),
    ),
    ("tracing (opentelemetry)", ("opentelemetry/", "gateway/tracing.py")),
    ("canary on_finish/anomalies", ("canary/runtime.py", "canary/anomalies.py")),
    ("anyio / threads", ("anyio/", "threading.py", "concurrent/futures")),
    ("asyncio/uvloop event loop", ("asyncio/", "uvloop/")),
    ("logging", ("logging/",)),
)


IDLE_LEAVES = (  # a worker thread waiting for work or for the database, not computing
    "wait (threading.py",
    "Watchdog._run (gateway/db/watchdog.py",  # the database watchdog's sleep between checks
    "Connection.wait (psycopg",
    "get (queue.py",
    "select (selectors.py",
)
# areas that only carry others' work: a sample is charged to them when no other area is on it
GENERIC = frozenset({"asyncio/uvloop event loop", "anyio / threads", "logging"})
LOOP_LEAF = "Runner.run (asyncio/runners.py"  # the main thread in uvloop's C code, no Python frame
C_LOOP = "event loop in C: uvloop/libuv socket I/O, epoll, timers (and any idle wait)"

Stack = tuple[int, list[str], int]  # thread id, frames (root first), samples


def parse_collapsed(text: str) -> list[Stack]:
    """py-spy's raw output with ``--threads``: ``thread (TID): name;frame;... count`` lines."""
    stacks = []
    for line in text.splitlines():
        head, _, count = line.rpartition(" ")
        if not (head and count.isdigit()):
            continue
        first, *frames = head.split(";")
        tid = int(first.split("(", 1)[1].split(")", 1)[0]) if first.startswith("thread") else 0
        stacks.append((tid, frames, int(count)))
    return stacks


def summarise(stacks: list[Stack], top: int = 25) -> str:
    """Shares of the samples in which a thread was not waiting. py-spy samples wall time, so on
    a busy machine a thread that waits for a CPU is sampled where it was preempted: the shares
    follow CPU time, and the closed loop keeps the event loop's own idle time small."""
    inclusive: Counter[str] = Counter()
    exclusive: Counter[str] = Counter()
    selfs: Counter[str] = Counter()
    total = 0
    for _, frames, count in stacks:
        leaf = frames[-1] if frames else ""
        if not frames or any(mark in leaf for mark in IDLE_LEAVES):
            continue
        total += count
        if LOOP_LEAF in leaf:
            inclusive[C_LOOP] += count
            exclusive[C_LOOP] += count
            continue
        areas = [_area(frame) for frame in reversed(frames)]  # leaf first
        for area in set(areas) - {None}:
            inclusive[str(area)] += count
        specific = [a for a in areas if a is not None and a not in GENERIC]
        generic = [a for a in areas if a is not None]
        exclusive[(specific or generic or ["other"])[0]] += count
        selfs[_short(leaf)] += count
    total = total or 1
    lines = [
        f"{total} samples",
        "",
        "| area (exclusive: the deepest specific area on the stack) | share |",
        "|---|---|",
    ]
    lines += [f"| {area} | {count / total:.1%} |" for area, count in exclusive.most_common()]
    lines += [
        "",
        "| area (inclusive: a sample counts for every area on its stack) | share |",
        "|---|---|",
    ]
    lines += [f"| {area} | {count / total:.1%} |" for area, count in inclusive.most_common()]
    lines += ["", "| function (self) | share |", "|---|---|"]
    lines += [f"| `{name}` | {count / total:.1%} |" for name, count in selfs.most_common(top)]
    return "\n".join(lines)


def _area(frame: str) -> str | None:
    for area, marks in AREAS:
        if any(mark in frame for mark in marks):
            return area
    return None


def _short(frame: str) -> str:
    """``func (path/to/site-packages/pkg/mod.py:12)`` -> ``func (pkg/mod.py:12)``."""
    name, _, where = frame.partition(" (")
    for marker in ("site-packages/", "/lib/python3.11/", "/work/wt/", "/work/main/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{name} ({where}" if where else name


async def _load(relay: Relay, stream: bool, seconds: float) -> None:
    from bench.bench_relay import workload

    driver = Driver("127.0.0.1", relay.port)
    await driver.closed(workload(relay, stream=stream), clients=CLIENTS[stream], seconds=seconds)


def record(relay: Relay, systems: Systems, seconds: float, tmp: Path) -> dict[str, str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out: dict[str, str] = {}
    assert relay.pid is not None
    for stream in (False, True):
        mode = "streaming" if stream else "non-streaming"
        raw = tmp / f"{mode}.txt"
        argv = [spy, "record", "--pid", str(relay.pid), "--format", "raw", "--threads"]
        argv += ["--nonblocking", "--rate", "250", "--duration", str(int(seconds))]
        argv += ["--output", str(raw)]
        spy_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        uvloop.run(_load(relay, stream, seconds))
        _, err = spy_proc.communicate(timeout=seconds + 60)
        if spy_proc.returncode != 0:
            raise RuntimeError(f"py-spy failed: {err.decode()[-1000:]}")
        out[mode] = summarise(parse_collapsed(raw.read_text()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from bench.bench_relay import INTERVAL_S
    from bench.run import commit

    pin_self()
    with tempfile.TemporaryDirectory(prefix="kvguard-relay-profile-") as tmp:
        systems = Systems(Path(tmp))
        try:
            systems.standin(engines=1, interval_s=INTERVAL_S)
            redis_url, database_url = systems.services()
            keys = tuple(create_tenants(database_url, 10, canary_rate=0.1))
            gateway = systems.gateway(
                redis_url=redis_url, database_url=database_url, engines=1, keys=keys
            )
            summaries = record(gateway, systems, args.seconds, Path(tmp))
        finally:
            systems.close()
    text = [
        "### Where the gateway's CPU goes (py-spy)",
        "",
        f"`python -m bench.relay_profile --seconds {args.seconds:g}` at commit {commit()}: a "
        f"closed loop of {CLIENTS[False]} non-streaming clients, then of {CLIENTS[True]} "
        "streaming ones (64-token answers, an event every 10 ms), every check on (see "
        "bench_relay).",
    ]
    for mode, summary in summaries.items():
        text += ["", f"#### {mode}", "", summary]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(text) + "\n")
    if args.out.resolve() == RESULTS:  # the profile of record: the benchmark page shows it
        relay_report.refresh_page()
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
