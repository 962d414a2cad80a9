"""Benchmark of the tenant-scoped prefix cache and of on-demand KV pages, each beside its baseline.

Run: ``python -m bench.bench_kvcache [--quick] [--rounds N]``. One CPU process, one random fp32
Llama (``bench_engine``'s shape), greedy, closed-loop clients (``bench.engine_common``: TTFT counts
queueing), every kvguard run on a freshly built engine (a cold cache), kvguard runs of the two
sides alternating ABBA over rounds; medians, with the spread (min..max) over rounds.

1. Multi-turn chat: 4 tenants, 32 clients (8 per tenant), each replaying a conversation of
   ``turns`` turns: turn k's prompt is the tenant's system prompt, then the k user messages and
   the k-1 assistant replies of the script before it (``bench.kvcache_workloads``). Sides:
   kvguard with the prefix cache (the default), kvguard without it (``prefix_cache=False``), and
   transformers ``generate()`` serial and static (``bench.engine_hf``) on the same prompts.
   Printed: TTFT p50, output tok/s, the share of prompt tokens read from the cache.
2. Long max_tokens: 32 clients ask for as much as fits (max_tokens = window - prompt) and stop at
   the end of their answer (a stop sequence: the client ends the stream, as the server does for
   ``stop``). Sides: on-demand pages (the default) vs the up-front reservation
   (``kv_allocation=reserve``), same pool and window. Printed: completed requests/s. The pool
   holds two full windows (4,096 tokens, a 2,048-token window: a long-context model on a device
   whose KV pool is twice its window), so the reservation runs two such requests at a time while
   on-demand pages run as many as the pool holds pages for; with more windows per pool the
   reservation runs more at once and the gain is smaller.
3. The isolation checks with shared pages: the share of engine step time spent in the read-path
   check (``kvguard_engine_step_seconds{phase="verify"}`` over verify + forward) in the cache-on
   runs, where page tables hold shared pages.

Goals (issue 24): TTFT p50 on shared prefixes cache off / on >= 2x; completed requests/s on-demand /
reserve >= 2x; isolation check < 1% of step time. Exit 1 if one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from backend.config import BackendSettings
from backend.engine.build import BuiltEngine, build_engine
from bench.engine_common import Summary, Trace, summarize, write_random_checkpoint
from bench.engine_ours import closed_loop, serve_engine
from bench.kvcache_workloads import ChatSpec, LongSpec, chat_workload, long_workload
from bench.summary import emit

SHAPE_NOTE = "random Llama, bench_engine's shape"
CHAT_FULL = ChatSpec(tenants=4, clients=32, turns=3, system_tokens=384, message_tokens=24)
CHAT_QUICK = ChatSpec(tenants=4, clients=32, turns=2, system_tokens=256, message_tokens=16)
LONG_FULL = LongSpec(requests=96, clients=32, prompt_range=(48, 160), answer_range=(24, 96))
LONG_QUICK = LongSpec(requests=64, clients=32, prompt_range=(48, 128), answer_range=(16, 64))
WINDOW, POOL, PAGE = 2048, 4096, 16
GOAL_TTFT, GOAL_REQUESTS, GOAL_VERIFY = 2.0, 2.0, 0.01
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Run:
    summary: Summary
    requests_per_s: float = 0.0
    hit_share: float = 0.0
    verify_share: float = 0.0
    preemptions: int = 0


def settings(checkpoint: Path, threads: int, **overrides: object) -> BackendSettings:
    base: dict[str, object] = {
        "model": checkpoint,
        "page_size": PAGE,
        "pool_tokens": POOL,
        "context_window": WINDOW,
        "max_running": 64,
        "torch_threads": threads,
    }
    return BackendSettings(**{**base, **overrides})


def _sample(built: BuiltEngine, name: str, **labels: str) -> float:
    value = built.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def run_chat(checkpoint: Path, spec: ChatSpec, cache: bool, threads: int, tag: str) -> Run:
    built = build_engine(settings(checkpoint, threads, prefix_cache=cache))
    built.engine.start()
    workload = chat_workload(spec)
    try:
        traces = await serve_engine(built.engine, workload, spec.clients, tag)
    finally:
        await built.engine.stop()
    hits = _sample(built, "kvguard_engine_prefix_cache_tokens_total", result="hit")
    misses = _sample(built, "kvguard_engine_prefix_cache_tokens_total", result="miss")
    verify = _sample(built, "kvguard_engine_step_seconds_sum", phase="verify")
    forward = _sample(built, "kvguard_engine_step_seconds_sum", phase="forward")
    side = "kvguard, prefix cache on" if cache else "kvguard, prefix cache off"
    return Run(
        summarize(side, spec.clients, traces),
        hit_share=hits / (hits + misses) if hits + misses else 0.0,
        verify_share=verify / (verify + forward),
    )


async def run_long(checkpoint: Path, spec: LongSpec, allocation: str, threads: int) -> Run:
    built = build_engine(settings(checkpoint, threads, kv_allocation=allocation))
    built.engine.start()
    workload = long_workload(spec, WINDOW)

    async def client(i: int, start: float) -> Trace:
        trace = Trace(sent=time.perf_counter() - start)
        generation = built.engine.submit(
            request_id=f"long-{allocation}-{i}",
            tenant=f"tenant-{i % 4}",
            prompt_ids=workload.prompt_ids(i),
            sampling=workload.sampling(i),
        )
        async for event in generation.events():
            if event.token is not None:
                trace.record(time.perf_counter() - start, event.token)
            if trace.tokens == workload.answers[i]:
                generation.abort()  # the answer ended: the client's stop sequence
                break
            if event.is_terminal:
                raise RuntimeError(f"request {i} ended early: {event.state} {event.error}")
        return trace

    started = time.perf_counter()
    try:
        traces = await closed_loop(workload.base, spec.clients, client)
    finally:
        await built.engine.stop()
    wall = time.perf_counter() - started
    preempted = int(_sample(built, "kvguard_engine_preemptions_total"))
    side = f"kvguard, {allocation.replace('_', '-')} pages"
    summary = summarize(side, spec.clients, traces)
    return Run(summary, requests_per_s=len(traces) / wall, preemptions=preempted)


def _on_worker(pool: ThreadPoolExecutor, fn: Callable[..., _T], *args: object) -> _T:
    return pool.submit(fn, *args).result()


def measure(checkpoint: Path, args: argparse.Namespace) -> dict[str, list[Run]]:
    """Every kvguard side, ``args.rounds`` times, ABBA; on a worker thread like the engine's."""
    chat = CHAT_QUICK if args.quick else CHAT_FULL
    long = LONG_QUICK if args.quick else LONG_FULL
    runs: dict[str, list[Run]] = {}

    def add(run: Run) -> None:
        runs.setdefault(run.summary.system, []).append(run)

    for rnd in range(args.rounds):
        order = (True, False) if rnd % 2 == 0 else (False, True)
        for cache in order:
            add(asyncio.run(run_chat(checkpoint, chat, cache, args.threads, f"c{rnd}{cache}")))
        for allocation in ("on_demand", "reserve") if rnd % 2 == 0 else ("reserve", "on_demand"):
            add(asyncio.run(run_long(checkpoint, long, allocation, args.threads)))
        print(f"  round {rnd + 1} of {args.rounds} done", flush=True)
    return runs


def transformers_chat(checkpoint: Path, spec: ChatSpec) -> list[Summary]:
    from bench.engine_hf import HfBaselines, serial_closed_loop

    hf = HfBaselines(checkpoint, torch.float32)
    workload = chat_workload(spec)
    hf.warm_up(workload)
    start, served = hf.serial(workload)
    c = spec.clients
    serial = summarize("transformers serial", c, serial_closed_loop(start, served, c))
    static = summarize("transformers static", c, hf.static(workload, c))
    return [serial, static]


def spread(values: Sequence[float], unit: str = "") -> str:
    return f"{min(values):,.2f}..{max(values):,.2f}{unit}" if len(values) > 1 else "-"


def median_of(runs: Sequence[Run], field: Callable[[Run], float]) -> float:
    return statistics.median(field(r) for r in runs)


def _ttft(r: Run) -> float:
    return r.summary.ttft_p50_ms


def _tps(r: Run) -> float:
    return r.summary.tokens_per_s


def _rps(r: Run) -> float:
    return r.requests_per_s


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def report_chat(on: list[Run], off: list[Run], hf: list[Summary]) -> bool:
    widths = (26, 11, 15, 8, 15, 10)
    print("\n1. multi-turn chat: 32 clients, 4 tenants, a system prompt per tenant")
    print(_row(("side", "TTFT p50 ms", "rounds", "tok/s", "rounds", "cache hits"), widths))
    for side in (on, off):
        hits = f"{100 * median_of(side, lambda r: r.hit_share):.0f}%"
        cells = (side[0].summary.system, f"{median_of(side, _ttft):,.0f}",
                 spread([_ttft(r) for r in side]), f"{median_of(side, _tps):,.1f}",
                 spread([_tps(r) for r in side]), hits)  # fmt: skip
        print(_row(cells, widths))
    for s in hf:
        cells = (s.system, f"{s.ttft_p50_ms:,.0f}", "-", f"{s.tokens_per_s:,.1f}", "-", "")
        print(_row(cells, widths))
    ttft = median_of(off, _ttft) / median_of(on, _ttft)
    per_round = spread([_ttft(b) / _ttft(a) for a, b in zip(on, off, strict=True)], "x")
    tps = median_of(on, _tps) / median_of(off, _tps)
    print(f"TTFT p50 off / on {ttft:.2f}x (rounds {per_round}); tok/s on / off {tps:.2f}x")
    measure = "TTFT p50, multi-turn chat, 32 clients, prefix cache off / on"
    emit("kvcache", measure, f"{ttft:.2f}x ({per_round})", f">= {GOAL_TTFT:g}x", ttft >= GOAL_TTFT)
    emit("kvcache", "tok/s, multi-turn chat, 32 clients, prefix cache on / off", f"{tps:.2f}x")
    for s in hf:
        faster = s.ttft_p50_ms / median_of(on, _ttft)
        more = median_of(on, _tps) / s.tokens_per_s
        measure = f"multi-turn chat, kvguard (cache on) / {s.system}: TTFT, tok/s"
        emit("kvcache", measure, f"{faster:.2f}x shorter, {more:.2f}x more")
    return ttft >= GOAL_TTFT


def report_long(demand: list[Run], reserve: list[Run]) -> bool:
    widths = (26, 10, 13, 11, 11)
    print("\n2. long max_tokens (as much as fits), 32 clients, answers end at a stop sequence")
    print(_row(("side", "requests/s", "rounds", "TTFT p50 ms", "preempted"), widths))
    for side in (demand, reserve):
        cells = (side[0].summary.system, f"{median_of(side, _rps):.2f}",
                 spread([_rps(r) for r in side]), f"{median_of(side, _ttft):,.0f}",
                 f"{median_of(side, lambda r: r.preemptions):.0f}")  # fmt: skip
        print(_row(cells, widths))
    ratio = median_of(demand, _rps) / median_of(reserve, _rps)
    per_round = spread([_rps(a) / _rps(b) for a, b in zip(demand, reserve, strict=True)], "x")
    print(f"completed requests/s on-demand / reserve {ratio:.2f}x (rounds {per_round})")
    measure = "completed requests/s, long max_tokens, 32 clients, on-demand / reserve pages"
    ok = ratio >= GOAL_REQUESTS
    emit("kvcache", measure, f"{ratio:.2f}x ({per_round})", f">= {GOAL_REQUESTS:g}x", ok)
    return ok


def report_verify(on: list[Run]) -> bool:
    share = median_of(on, lambda r: r.verify_share)
    rounds = spread([100 * r.verify_share for r in on], "%")
    print(f"\n3. read-path check with shared pages: {100 * share:.3f}% of step time ({rounds})")
    ok = share < GOAL_VERIFY
    measure = "read-path check, share of step time, prefix cache on (shared pages)"
    emit("kvcache", measure, f"{100 * share:.3f}%", f"< {100 * GOAL_VERIFY:g}%", ok)
    return ok


def report(runs: dict[str, list[Run]], hf: list[Summary]) -> bool:
    on, off = runs["kvguard, prefix cache on"], runs["kvguard, prefix cache off"]
    demand, reserve = runs["kvguard, on-demand pages"], runs["kvguard, reserve pages"]
    results = [report_chat(on, off, hf), report_long(demand, reserve), report_verify(on)]
    return all(results)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument(
        "--rounds", type=int, help="rounds of each kvguard side (default 3, quick 2)"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 3)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from bench.bench_engine import SHAPE, machine

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"command: python -m bench.bench_kvcache {' '.join(sys.argv[1:] if argv is None else argv)}"
    )
    print(f"machine: {machine()}; torch {torch.__version__}, {args.threads} threads, fp32, greedy")
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    chat = CHAT_QUICK if args.quick else CHAT_FULL
    long = LONG_QUICK if args.quick else LONG_FULL
    print(f"chat workload: {chat.describe()}")
    print(f"long workload: {long.describe()}; window {WINDOW}, pool {POOL} tokens, pages {PAGE}")
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-") as tmp:
        checkpoint = Path(tmp) / "random-llama"
        params = write_random_checkpoint(checkpoint, SHAPE, seed=0)
        print(f"model: {SHAPE_NOTE}, {params / 1e6:.1f}M params, {SHAPE.describe()}", flush=True)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench") as pool:
            runs = _on_worker(pool, measure, checkpoint, args)
            hf = _on_worker(pool, transformers_chat, checkpoint, chat) if args.hf else []
    ok = report(runs, hf)
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
