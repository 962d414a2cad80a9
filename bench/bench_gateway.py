"""Gateway-added latency: the same open-loop load sent straight to the engine and through the
gateway (API key auth, Redis limits, exact token count, capacity check all on).

Run: ``python -m bench.bench_gateway`` (``--help`` for options). It starts a private Redis, the
real engine (``kvguard backend unified`` on a small random byte-level checkpoint) and the
gateway (``kvguard gateway``) as processes, creates a limited tenant, then for each rate sends
``--seconds`` of requests per path at fixed intervals (open loop: a slow answer does not slow the
sender), split into ``--rounds`` alternating rounds with the path order rotated each round (a
stall of the shared machine then falls on every path alike), and prints p50/p99 latency per path
over all its rounds, and what the gateway adds over calling the engine directly at the same
rate. Paths:

- ``direct``: client -> engine.
- ``gateway``: client -> gateway (direct aiohttp upstream) -> engine.
- ``gateway+litellm``: the same engine registered as a litellm provider (``openai/<model>``),
  i.e. the gateway calling ``litellm.acompletion``: litellm's per-request overhead in-process.

The LiteLLM *proxy* (a separate server in front of the engine) is measured side by side with the
gateway and the direct path by ``bench.bench_proxy``.

Goal: the gateway adds under 5 ms at p99 at 100 requests/s. Exit status 1 if missed.

``--firewall-cpu`` measures instead what the canary leak firewall costs the gateway's CPU at load
(issue 7's goal: under 1%): two gateway processes on the same engine (the bundled model, which
echoes the user's line, so answers are prose with capitalised ``C``-words the scanner must look
at), one with the canary on and one with ``KVGUARD_CANARY_ENABLED=0``, take the same streaming
chat load in alternating rounds; the gateway process's CPU seconds (user + system, from
``/proc``) per request are printed side by side with their ratio. That end-to-end difference is
within the run-to-run noise of a shared 2-core machine (the per-round column shows it), so the
headline attributes the firewall's CPU directly: one real answer of the engine (its SSE bytes) is
replayed through the gateway's ``StreamRelay`` with pass-through guards and with the
``LeakFirewall``, in this process, in back-to-back pairs of batches; the median per-pair
difference per response over the gateway's measured CPU per request (firewall on) is the
firewall's share. The default load, 10 streamed 64-token answers per second, is what the bundled
engine serves on a 2-core machine without queueing (at 20/s answers wait seconds for the engine,
and the gateway's CPU per request drops as its event loop batches: a larger share, see
``--cpu-rate``).
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
from pathlib import Path

import httpx

from backend.config import BUNDLED_MODEL_DIR
from bench.gateway_load import Result, create_tenant, open_loop, pooled, start_gateway
from bench.summary import emit
from kvguard.localservices import redis_server
from kvguard.testing import EngineProcess, launch_engine, write_tiny_checkpoint

GOAL_ADDED_P99_MS = 5.0
GOAL_RATE = 100
GOAL_FIREWALL_CPU_SHARE = 0.01


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
    return "\n".join(lines)


async def run(args: argparse.Namespace, engine: EngineProcess, env: dict[str, str]) -> int:
    model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    key = create_tenant(env)
    log = Path(env["KVGUARD_DATA_DIR"]) / "gateway.log"
    gateway, gateway_url = start_gateway(engine.url, model, env, log)
    try:
        body = {"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0}
        auth = {"Authorization": f"Bearer {key}"}
        paths = [
            ("direct", f"{engine.url}/v1/completions", {}, body),
            ("gateway", f"{gateway_url}/v1/completions", auth, body),
        ]
        if not args.skip_litellm:
            litellm_body = {**body, "model": "bench-litellm"}
            paths.append(("gateway+litellm", f"{gateway_url}/v1/completions", auth, litellm_body))
        results = []
        for rate in args.rates:
            # alternating rounds, the order rotated each round: a stall of the shared machine
            # falls on every path alike instead of on whichever ran at that moment
            parts: dict[str, list[Result]] = {name: [] for name, *_ in paths}
            for round_ in range(args.rounds):
                shift = round_ % len(paths)
                for name, url, headers, path_body in paths[shift:] + paths[:shift]:
                    seconds = args.seconds / args.rounds
                    part = await open_loop(url, headers, path_body, rate, seconds, name)
                    parts[name].append(part)
            results += [pooled(parts[name]) for name, *_ in paths]
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
    emit(
        "gateway",
        f"gateway added p99 over direct at {GOAL_RATE}/s, non-streaming",
        f"{added:.2f} ms",
        f"< {GOAL_ADDED_P99_MS} ms",
        verdict == "met",
    )
    return 0 if verdict == "met" else 1


# The user's line the bundled model echoes: prose with the capitalised words (and marker-like
# prefixes) that make the scanner hold characters back, as in bench_firewall.
ECHO_LINE = (
    "The Cache Context of each Node holds the Request data. CN values and CNRX keys come "
    "from the Canary page pool because the decode tenant copies the Context window."
)


def echo_body(model: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": ECHO_LINE}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def replay_cpu_s(raw: bytes, repeats: int, pairs: int = 15) -> tuple[float, float, float]:
    """CPU seconds per response of the gateway's relay over ``raw``: (pass-through, firewall,
    firewall minus pass-through). ``pairs`` back-to-back batches of ``repeats`` responses per side;
    the difference is the median over the pairs (a stall of the shared machine falls on one pair,
    not on one side), each side's time its median batch."""
    from canary.firewall import LeakFirewall, TagIndex
    from canary.injection import MarkerLedger, RequestMarkers
    from canary.markers import MarkerCodec, MarkerKeyring
    from contracts.plugins import PassThroughGuard, RequestInfo
    from contracts.sse import SseSplitter
    from gateway.proxy.relay import StreamRelay
    from gateway.upstream.base import Endpoint

    codec = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
    tags = TagIndex(codec)
    tags.replace(f"tn_{i:05d}" for i in range(1000))
    ledger = MarkerLedger()
    firewall = LeakFirewall(codec, ledger=ledger, tags=tags)
    info = RequestInfo("r1", "tn_00001", "m", "chat.completions", False, 0.0, "e1")
    ledger.put("r1", RequestMarkers(own=frozenset()))

    def one(guarded: bool) -> None:
        relay = StreamRelay(
            endpoint=Endpoint.CHAT,
            open_guard=(lambda: firewall.open(info)) if guarded else PassThroughGuard,
            wants_usage=False,
            screen_side=guarded,
            side_prefilter=firewall.capabilities.side_prefilter if guarded else None,
        )
        for event in SseSplitter().feed(raw):
            relay.on_event(event)

    batches: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(pairs):
        for guarded in (False, True):
            start = time.process_time()
            for _ in range(repeats):
                one(guarded)
            batches[guarded].append((time.process_time() - start) / repeats)
    diffs = [on - off for off, on in zip(batches[False], batches[True], strict=True)]
    return (
        statistics.median(batches[False]),
        statistics.median(batches[True]),
        statistics.median(diffs),
    )


async def cpu_rounds(
    args: argparse.Namespace, gateways: dict[str, tuple[subprocess.Popen, str, str]], model: str
) -> dict[str, list[Result]]:
    """Alternating rounds of the same load on each gateway, its process's CPU measured."""
    body = echo_body(model, args.max_tokens)
    results: dict[str, list[Result]] = {side: [] for side in gateways}
    for _ in range(args.cpu_rounds):
        for side, (proc, url, key) in gateways.items():
            result = await open_loop(
                f"{url}/v1/chat/completions",
                {"Authorization": f"Bearer {key}"},
                body,
                args.cpu_rate,
                args.seconds,
                side,
                cpu_pid=proc.pid,
            )
            results[side].append(result)
    return results


def cpu_table(results: dict[str, list[Result]]) -> tuple[str, dict[str, float]]:
    lines = [
        "| gateway | rounds | requests ok | errors | CPU s | CPU ms/request | per round | "
        "p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    per_request: dict[str, float] = {}
    for side, rows in results.items():
        ok = sum(r.sent - r.errors for r in rows)
        cpu = sum(r.cpu_s or 0.0 for r in rows)
        per_request[side] = cpu / ok if ok else float("nan")
        rounds = " ".join(
            f"{(r.cpu_s or 0.0) * 1000 / max(1, r.sent - r.errors):.2f}" for r in rows
        )
        lines.append(
            f"| {side} | {len(rows)} | {ok} | {sum(r.errors for r in rows)} | {cpu:.2f} | "
            f"{per_request[side] * 1000:.3f} | {rounds} | "
            f"{statistics.median(r.p50_ms for r in rows):.1f} | {max(r.p99_ms for r in rows):.1f} |"
        )
    return "\n".join(lines), per_request


def firewall_cpu(args: argparse.Namespace) -> int:
    """Gateway CPU per request with the leak firewall on vs off, same engine, same load."""
    with tempfile.TemporaryDirectory() as tmp, redis_server() as redis:
        engine = launch_engine(str(BUNDLED_MODEL_DIR), pool_tokens=16384, context_window=2048)
        gateways: dict[str, tuple[subprocess.Popen, str, str]] = {}
        try:
            model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
            for side, enabled in (("firewall off", "0"), ("firewall on", "1")):
                data = Path(tmp) / ("on" if enabled == "1" else "off")
                data.mkdir()
                env = {
                    **os.environ,
                    "KVGUARD_DATABASE_URL": f"sqlite:///{data}/gateway.db",
                    "KVGUARD_DATA_DIR": str(data),
                    "KVGUARD_REDIS_URL": redis.url,
                    "KVGUARD_CANARY_ENABLED": enabled,
                }
                key = create_tenant(env)
                proc, url = start_gateway(
                    engine.url, model, env, data / "gateway.log", litellm=False
                )
                gateways[side] = (proc, url, key)
            results = asyncio.run(cpu_rounds(args, gateways, model))
            answer = httpx.post(
                f"{engine.url}/v1/chat/completions",
                json=echo_body(model, args.max_tokens),
                timeout=120,
            ).content
        finally:
            for proc, _, _ in gateways.values():
                proc.terminate()
                proc.wait(timeout=15)
            engine.stop()
    text, per_request = cpu_table(results)
    print(text)
    off, on = per_request["firewall off"], per_request["firewall on"]
    base_s, fw_s, added_s = replay_cpu_s(answer, repeats=200)
    events = answer.count(b"\n\n")
    share = added_s / on
    met = share < GOAL_FIREWALL_CPU_SHARE
    print(
        f"\nend to end, on vs off: {(on - off) / on * 100:+.2f}% of the gateway's CPU per request "
        f"(on/off = {on / off:.4f}; run-to-run noise: see the per-round column)"
    )
    print(
        f"relay replay of one real answer ({events} SSE events, {len(answer)} bytes): "
        f"pass-through {base_s * 1e6:.0f} us, firewall {fw_s * 1e6:.0f} us of CPU per response"
    )
    print(
        f"firewall share of gateway CPU: {added_s * 1e3:.3f} ms of {on * 1e3:.2f} ms per "
        f"request = {share * 100:.2f}% (goal < {GOAL_FIREWALL_CPU_SHARE * 100:.0f}%): "
        f"{'met' if met else 'MISSED'} at {args.cpu_rate} requests/s, {args.max_tokens}-token "
        "streamed answers"
    )
    emit(
        "gateway",
        f"firewall CPU / gateway CPU per request at {args.cpu_rate}/s",
        f"{share * 100:.2f}%",
        f"< {GOAL_FIREWALL_CPU_SHARE * 100:.0f}%",
        met,
    )
    return 0 if met else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=int, nargs="+", default=[25, 50, 100])
    parser.add_argument("--seconds", type=float, default=15.0, help="per path and rate")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (>= 1)")
    parser.add_argument("--skip-litellm", action="store_true")
    parser.add_argument("--firewall-cpu", action="store_true", help="firewall on vs off: CPU")
    parser.add_argument("--cpu-rate", type=int, default=10, help="requests/s (--firewall-cpu)")
    parser.add_argument("--cpu-rounds", type=int, default=2, help="alternating rounds per side")
    parser.add_argument("--max-tokens", type=int, default=64, help="answer length (--firewall-cpu)")
    args = parser.parse_args(argv)
    if args.firewall_cpu:
        return firewall_cpu(args)
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
