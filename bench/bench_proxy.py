"""Gateway vs direct vs LiteLLM proxy: the same load on the same engine, side by side.

Run: ``python -m bench.bench_proxy [--quick] [--rates 100] [--seconds 20]`` (``--help``).

Lifecycle:

1. Start a private Redis, the bundled engine (``kvguard backend unified``, kvguard-tiny), a
   limited tenant and the kvguard gateway (tenant key, Redis limits, exact token count, capacity
   check, canary leak firewall on), and a LiteLLM proxy (``litellm --config``) that serves the
   same engine as an OpenAI-compatible backend with its own master-key check on.
2. The LiteLLM proxy runs from its own virtual environment (``bench.litellm_proxy``), offline.
   If it cannot be installed or started, the bench says why and measures direct and gateway only.
3. For non-streaming and then streaming chat completions (small ``max_tokens``), at each rate:
   ``--rounds`` rounds, each sending ``--seconds / --rounds`` of open-loop load (fixed send
   times; a slow answer does not slow the sender) to every path in turn, the order rotated each
   round, so background load on the shared machine falls on all paths alike. Then a short
   closed loop (``--concurrency`` clients back to back) per path gives its throughput.
4. Print one table (p50/p99 end-to-end latency, TTFT when streaming, what each path adds over
   direct, the middle process's CPU per request, throughput) and ``bench.summary`` headlines:
   the gateway's added p99 at 100/s (goal < 5 ms, issue 6) and the gateway's added latency over
   LiteLLM proxy's (goal: less, at every measured rate). Exit status 1 if a goal is missed.

Added latency is a difference of percentiles (path p99 - direct p99), as in
``bench.bench_gateway``: both sets were measured in the same rounds at the same rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from backend.config import BUNDLED_MODEL_DIR
from bench.gateway_load import create_tenant, percentile, process_cpu_s, start_gateway
from bench.litellm_proxy import PROXY_KEY, PROXY_MODEL, ensure_litellm_venv, start_litellm_proxy
from bench.summary import emit
from kvguard.localservices import redis_server
from kvguard.testing import launch_engine

GOAL_ADDED_P99_MS = 5.0
GOAL_RATE = 100
MODES = ("non-streaming", "streaming")
REQUEST_TIMEOUT_S = 20.0  # a request slower than this counts as an error


@dataclass(frozen=True, slots=True)
class Target:
    """One way to reach the engine: where to send, with which key and model name."""

    name: str
    url: str
    headers: dict[str, str]
    model: str
    pid: int | None  # the middle process (gateway or proxy) whose CPU is measured


@dataclass(slots=True)
class Samples:
    """Everything measured for one path, mode and rate, merged over rounds."""

    latencies_ms: list[float] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)
    sent: int = 0
    errors: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0  # from the first send to the last answer, summed over rounds
    throughput: float | None = None  # closed-loop requests/s

    def achieved(self) -> float:
        """Answers per second while the load ran (below the offered rate: the path saturated)."""
        return len(self.latencies_ms) / self.wall_s if self.wall_s else 0.0

    def p(self, q: float, ttft: bool = False) -> float:
        values = self.ttfts_ms if ttft else self.latencies_ms
        return percentile(values, q) if values else float("nan")


# ---- the stack --------------------------------------------------------------------------------


@dataclass(slots=True)
class Stack:
    paths: list[Target]
    proxy_missing: str | None  # why the LiteLLM proxy is not measured, if it is not


@contextmanager
def stack(args: argparse.Namespace, tmp: Path) -> Iterator[Stack]:
    with ExitStack() as stop:
        redis = stop.enter_context(redis_server())
        engine = launch_engine(str(BUNDLED_MODEL_DIR), pool_tokens=16384, context_window=2048)
        stop.callback(engine.stop)
        model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
        env = {
            **os.environ,
            "KVGUARD_DATABASE_URL": f"sqlite:///{tmp}/gateway.db",
            "KVGUARD_DATA_DIR": str(tmp),
            "KVGUARD_REDIS_URL": redis.url,
            "KVGUARD_CANARY_ENABLED": "1",
        }
        key = create_tenant(env)
        gateway, gateway_url = start_gateway(engine.url, model, env, tmp / "gw.log", litellm=False)
        stop.callback(_terminate, gateway)
        paths = [
            Target("direct", engine.url, {}, model, None),
            Target("gateway", gateway_url, {"Authorization": f"Bearer {key}"}, model, gateway.pid),
        ]
        missing = None if args.skip_proxy else ensure_litellm_venv()
        if args.skip_proxy:
            missing = "skipped (--skip-proxy)"
        if missing is None:
            proxy, url = start_litellm_proxy(engine.url, model, tmp)
            stop.callback(_terminate, proxy)
            auth = {"Authorization": f"Bearer {PROXY_KEY}"}
            paths.append(Target("litellm proxy", url, auth, PROXY_MODEL, proxy.pid))
        for path in list(paths):
            reason = wait_serving(path, tmp)
            if reason is not None and path.name == "litellm proxy":
                paths.remove(path)
                missing = reason
            elif reason is not None:
                raise RuntimeError(f"{path.name}: {reason}")
        yield Stack(paths, missing)


def _terminate(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_serving(path: Target, tmp: Path, timeout_s: float = 180.0) -> str | None:
    """Poll the path with the bench's own request until it answers 200; None, or why not."""
    body = request_body(path, stream=False, max_tokens=1)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{path.url}/v1/chat/completions", json=body, headers=path.headers)
            if r.status_code == 200:
                return None
            last = f"HTTP {r.status_code}: {r.text[:300]}"
        except httpx.HTTPError as error:
            last = repr(error)
        time.sleep(0.5)
    logs = {"gateway": "gw.log", "litellm proxy": "litellm.log"}
    tail = (tmp / logs[path.name]).read_text()[-1500:] if path.name in logs else ""
    return f"not serving after {timeout_s:.0f} s ({last}); log tail: {tail}"


# ---- load -------------------------------------------------------------------------------------


def request_body(path: Target, *, stream: bool, max_tokens: int) -> dict[str, object]:
    return {
        "model": path.model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def one_request(
    client: httpx.AsyncClient, path: Target, body: dict[str, object]
) -> tuple[float, float] | None:
    """(end-to-end ms, first-content ms) of one request, or None if it failed."""
    started = time.perf_counter()
    first: float | None = None
    tail = b""  # the end of the body: a complete stream ends with [DONE]
    try:
        url = f"{path.url}/v1/chat/completions"
        async with client.stream("POST", url, json=body, headers=path.headers) as response:
            async for chunk in response.aiter_bytes():
                first = first if first is not None else time.perf_counter()
                tail = (tail + chunk)[-64:]
            if response.status_code != 200 or (body["stream"] and b"[DONE]" not in tail):
                return None
    except httpx.HTTPError:
        return None
    ended = time.perf_counter()
    return (ended - started) * 1000, ((first or ended) - started) * 1000


async def fixed_rate(
    client: httpx.AsyncClient, path: Target, body: dict[str, object], rate: int, seconds: float
) -> Samples:
    samples = Samples()

    async def send(at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        result = await one_request(client, path, body)
        if result is None:
            samples.errors += 1
        else:
            samples.latencies_ms.append(result[0])
            samples.ttfts_ms.append(result[1])

    samples.sent = int(rate * seconds)
    cpu_before = process_cpu_s(path.pid) if path.pid is not None else 0.0
    start = time.perf_counter() + 0.05
    await asyncio.gather(*(send(start + i / rate) for i in range(samples.sent)))
    samples.wall_s = time.perf_counter() - start
    samples.cpu_s = process_cpu_s(path.pid) - cpu_before if path.pid is not None else 0.0
    return samples


async def closed_loop(
    client: httpx.AsyncClient, path: Target, body: dict[str, object], clients: int, seconds: float
) -> float:
    """Requests/s completed by ``clients`` back-to-back senders in ``seconds``."""
    done = 0
    until = time.perf_counter() + seconds

    async def sender() -> None:
        nonlocal done
        while time.perf_counter() < until:
            if await one_request(client, path, body) is not None:
                done += 1

    started = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(clients)))
    return done / (time.perf_counter() - started)


def merge(into: Samples, more: Samples) -> None:
    into.latencies_ms += more.latencies_ms
    into.ttfts_ms += more.ttfts_ms
    into.sent += more.sent
    into.errors += more.errors
    into.cpu_s += more.cpu_s
    into.wall_s += more.wall_s


Key = tuple[str, str, int]  # (mode, path name, rate)


async def measure(args: argparse.Namespace, paths: list[Target]) -> dict[Key, Samples]:
    results: dict[Key, Samples] = {}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        for mode in args.modes:
            bodies = {
                p.name: request_body(p, stream=mode == "streaming", max_tokens=args.max_tokens)
                for p in paths
            }
            for p in paths:  # warm connections and code paths
                await asyncio.gather(*(one_request(client, p, bodies[p.name]) for _ in range(20)))
            for rate in args.rates:
                for r in range(args.rounds):
                    for p in paths[r % len(paths) :] + paths[: r % len(paths)]:
                        print(f"{mode} {rate}/s round {r + 1}: {p.name}", file=sys.stderr)
                        got = await fixed_rate(
                            client, p, bodies[p.name], rate, args.seconds / args.rounds
                        )
                        merge(results.setdefault((mode, p.name, rate), Samples()), got)
            per_path: dict[str, list[float]] = {p.name: [] for p in paths}
            for r in range(args.rounds):  # alternating, as the fixed-rate rounds
                for p in paths[r % len(paths) :] + paths[: r % len(paths)]:
                    seconds = args.closed_seconds / args.rounds
                    tput = await closed_loop(client, p, bodies[p.name], args.concurrency, seconds)
                    per_path[p.name].append(tput)
            for p in paths:
                for rate in args.rates:
                    results[(mode, p.name, rate)].throughput = statistics.mean(per_path[p.name])
    return results


# ---- report -----------------------------------------------------------------------------------


def added(results: dict[Key, Samples], key: Key, q: float, ttft: bool = False) -> float:
    """What the path adds over direct at the same mode and rate (a difference of percentiles)."""
    mode, _, rate = key
    return results[key].p(q, ttft) - results[(mode, "direct", rate)].p(q, ttft)


def table(results: dict[Key, Samples]) -> str:
    lines = [
        "| mode | path | rate/s | achieved/s | ok | errors | p50 ms | p99 ms | added p50 ms "
        "| added p99 ms | TTFT p50/p99 ms | CPU ms/req | closed-loop req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in results.items():
        mode, name, rate = key
        extra = ("-", "-")
        if name != "direct":
            extra = (f"{added(results, key, 0.5):.2f}", f"{added(results, key, 0.99):.2f}")
        ttft = f"{s.p(0.5, True):.1f} / {s.p(0.99, True):.1f}" if mode == "streaming" else "-"
        ok = len(s.latencies_ms)
        cpu = f"{s.cpu_s * 1000 / ok:.2f}" if name != "direct" and ok else "-"
        tput = f"{s.throughput:.0f}" if s.throughput is not None else "-"
        lines.append(
            f"| {mode} | {name} | {rate} | {s.achieved():.0f} | {ok} | {s.errors} "
            f"| {s.p(0.5):.2f} | {s.p(0.99):.2f} | {extra[0]} | {extra[1]} | {ttft} | {cpu} "
            f"| {tput} |"
        )
    saturated = [f"{m} {n} at {r}/s" for (m, n, r), s in results.items() if saturated_at(s, r)]
    if saturated:
        lines.append(
            "\nsaturated (answered < 90% of the offered rate, so latency there is mostly "
            "queueing; when direct is among them, the engine itself is the limit): "
            + ", ".join(saturated)
        )
    return "\n".join(lines)


def saturated_at(samples: Samples, rate: int) -> bool:
    return samples.achieved() < 0.9 * rate


def unjudged(results: dict[Key, Samples], mode: str, rate: int, paths: tuple[str, ...]) -> str:
    """Why a goal on ``paths``' added p99 at this mode and rate cannot be judged ('' if it can):
    the direct path saturated (every path's latency there is queueing), or it stalled (its p99
    above a path's: the difference says nothing about the path)."""
    direct = results[(mode, "direct", rate)]
    if saturated_at(direct, rate):
        return f"the engine saturated (direct answered {direct.achieved():.0f}/s)"
    if any(added(results, (mode, path, rate), 0.99) < 0 for path in paths):
        return f"the direct path stalled (its p99 {direct.p(0.99):.0f} ms)"
    return ""


def headlines(results: dict[Key, Samples], rates: list[int], modes: list[str]) -> bool:
    """Emit the headline comparisons; True if every goal that was evaluated is met.

    A goal is not evaluated at a rate where the direct path itself saturated (the engine could
    not answer the offered rate on this machine): every path's latency there is queueing; nor
    where it stalled (a path's added p99 below zero).
    """
    all_met = True
    if GOAL_RATE in rates and "non-streaming" in modes:
        all_met &= goal_headline(results)
    for mode in modes:
        for rate in rates:
            if (mode, "litellm proxy", rate) not in results:
                continue
            ours, theirs = (
                added(results, (mode, name, rate), 0.99) for name in ("gateway", "litellm proxy")
            )
            why = unjudged(results, mode, rate, ("gateway", "litellm proxy"))
            met = None if why else ours < theirs
            all_met &= met is not False
            note = f" (not judged: {why})" if why else ""
            emit(
                "proxy",
                f"added p99 over direct at {rate}/s {mode}, kvguard gateway vs LiteLLM proxy{note}",
                f"{ours:.2f} vs {theirs:.2f} ms",
                "gateway less",
                met,
            )
        gw = results[(mode, "gateway", rates[0])].throughput
        px = results.get((mode, "litellm proxy", rates[0]))
        if px is not None and gw and px.throughput:
            emit(
                "proxy",
                f"closed-loop throughput {mode}, kvguard gateway / LiteLLM proxy",
                f"{gw / px.throughput:.2f}x",
            )
    return all_met


def goal_headline(results: dict[Key, Samples]) -> bool:
    """Issue 6's goal: the gateway adds < 5 ms p99 at 100/s (non-streaming). False if missed."""
    key = ("non-streaming", "gateway", GOAL_RATE)
    value = added(results, key, 0.99)
    measure = f"gateway added p99 over direct at {GOAL_RATE}/s, non-streaming"
    goal = f"< {GOAL_ADDED_P99_MS:.0f} ms"
    why = unjudged(results, "non-streaming", GOAL_RATE, ("gateway",))
    if why:
        emit("proxy", measure, f"{value:.2f} ms; not evaluated: {why}", goal, None)
        return True
    met = value < GOAL_ADDED_P99_MS and results[key].errors == 0
    emit("proxy", measure, f"{value:.2f} ms", goal, met)
    return met


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="20 and 100/s, 10 s per path, 2 rounds"
    )
    parser.add_argument("--rates", type=int, nargs="+", default=[20, 50, GOAL_RATE])
    parser.add_argument("--seconds", type=float, default=20.0, help="per path, mode and rate")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (>= 1)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--closed-seconds", type=float, default=8.0, help="closed loop, per path")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--skip-proxy", action="store_true", help="direct and gateway only")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.seconds, args.rounds, args.closed_seconds = [20, GOAL_RATE], 10.0, 2, 5.0
    if args.rounds < 1 or args.seconds <= 0 or min(args.rates) <= 0:
        parser.error("--rounds, --seconds and --rates must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
    with (
        tempfile.TemporaryDirectory(prefix="kvguard-bench-proxy-") as tmp,
        stack(args, Path(tmp)) as running,
    ):
        results = asyncio.run(measure(args, running.paths))
    after = os.getloadavg()
    print(
        f"{os.cpu_count()} CPUs; load average before {load[0]:.1f} / after {after[0]:.1f} "
        f"(1 min); max_tokens {args.max_tokens}; {args.rounds} rounds of "
        f"{args.seconds / args.rounds:.1f} s per path; closed loop {args.concurrency} clients"
    )
    print(table(results))
    if running.proxy_missing is not None:
        print(f"\nLiteLLM proxy not measured: {running.proxy_missing}")
    return 0 if headlines(results, args.rates, args.modes) else 1


if __name__ == "__main__":
    sys.exit(main())
