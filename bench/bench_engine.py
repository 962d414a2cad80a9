"""Benchmark of the kvguard engine against ``transformers`` ``generate()``, and of its isolation.

Run: ``python -m bench.bench_engine [--quick]`` (``--help`` for options). On one CPU, same process,
same torch threads, same fp32 checkpoint, same seeded prompts and ``max_tokens``, greedy:

1. a randomly initialised Llama written into a temp dir (and ``backend/bundled/kvguard-tiny`` when
   it exists) is served at 1, 8 and 32 concurrent closed-loop clients by
   - kvguard: every client submits to one in-process ``AsyncEngine`` (continuous batching),
   - transformers serial: ``generate()`` per request, one after another,
   - transformers static: one padded ``generate()`` per batch of ``concurrency`` requests;
   and once through the real HTTP server (uvicorn in this process) to show the HTTP overhead.
   Printed: output tokens/s, TTFT p50, per-token latency p50, and ours/baseline ratios.
2. the cost of isolation (``bench.engine_isolation``): decode throughput with the read-path
   ownership check (``verify_pages``) switched on/off between adjacent decode steps, and with
   ``zero_on_free`` on/off in whole runs interleaved ABBA; medians of the paired ratios.

The machine may be shared: every system runs on a worker thread (as the engine loop does), the
systems are interleaved within a round and rounds alternate direction (``--rounds``, medians),
and the load average is printed at the start and the end.

Goals (issue 3): ahead of both transformers baselines at every concurrency, >= 3x the throughput
of each at 32 concurrent requests, and the ownership check < 1% of decode throughput. Exit 1 if
any is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import torch

from backend.config import BackendSettings
from backend.engine.async_engine import AsyncEngine
from backend.model.llama import LlamaModel
from bench.engine_common import (
    ModelShape,
    Summary,
    Trace,
    Workload,
    WorkloadSpec,
    make_workload,
    same_outputs,
    summarize,
    write_random_checkpoint,
)
from bench.engine_isolation import isolation_report, measure_isolation
from bench.summary import emit

BUNDLED = Path(__file__).resolve().parent.parent / "backend" / "bundled" / "kvguard-tiny"
SHAPE = ModelShape(hidden=512, layers=12, intermediate=1536, heads=8, kv_heads=4)
# --quick keeps the shape of the full workload (prompt lengths over a 32x range, max_tokens over
# 16x) at a smaller scale.
FULL = WorkloadSpec(requests=64, prompt_range=(16, 512), output_range=(16, 256), seed=1)
QUICK = WorkloadSpec(requests=40, prompt_range=(8, 256), output_range=(4, 64), seed=1)
# the isolation runs want many decode steps per run
ISO_FULL = WorkloadSpec(requests=32, prompt_range=(16, 512), output_range=(64, 256), seed=2)
ISO_QUICK = WorkloadSpec(requests=32, prompt_range=(8, 256), output_range=(16, 64), seed=2)
GOAL_AT_32 = 3.0
_T = TypeVar("_T")


@dataclass(slots=True)
class ModelResult:
    name: str
    rows: list[Summary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, system: str, concurrency: int) -> Summary | None:
        for r in self.rows:
            if r.system == system and r.concurrency == concurrency:
                return r
        return None


OURS, SERIAL, STATIC, HTTP = "kvguard", "hf serial", "hf static", "kvguard http"


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs ({model}), Python {platform.python_version()}"
    )


def thread_counts() -> tuple[int, int]:
    """torch intra-op threads seen by this thread and by a fresh one (the engine runs on one)."""
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    return torch.get_num_threads(), seen[0]


def engine_settings(
    checkpoint: Path, workload_longest: int, concurrency: int, threads: int
) -> BackendSettings:
    """The shipped defaults, with a pool that holds ``concurrency`` of the longest requests
    (pages are reserved whole at admission)."""
    page = 16
    pages_each = -(-workload_longest // page)
    return BackendSettings(
        model=checkpoint,
        page_size=page,
        pool_tokens=concurrency * pages_each * page,
        max_running=max(64, concurrency),
        zero_on_free=True,
        torch_threads=threads,
    )


def median_summary(samples: Sequence[Summary]) -> Summary:
    first = samples[0]
    note = first.note if len(samples) == 1 else f"{first.note}; median of {len(samples)} rounds"
    return Summary(
        system=first.system,
        concurrency=first.concurrency,
        tokens=first.tokens,
        wall_s=statistics.median(s.wall_s for s in samples),
        ttft_p50_ms=statistics.median(s.ttft_p50_ms for s in samples),
        tpot_p50_ms=statistics.median(s.tpot_p50_ms for s in samples),
        note=note,
    )


def round_plan(concurrencies: Sequence[int], rnd: int, *, with_hf: bool) -> list[tuple[str, int]]:
    """serial, then kvguard and static at each concurrency; odd rounds run it backwards."""
    plan = [(SERIAL, 0)] + [
        (k, c) for c in concurrencies for k in (OURS, STATIC) if c > 1 or k == OURS
    ]
    plan = [(k, c) for k, c in plan if with_hf or k == OURS]
    return plan[::-1] if rnd % 2 else plan


class _Session:
    """One checkpoint's measurements: our engine, the transformers baselines (when transformers
    can load the checkpoint), and every summary and token trace they produced."""

    def __init__(self, checkpoint: Path, spec: WorkloadSpec, args: argparse.Namespace) -> None:
        from backend.engine.build import build_engine
        from bench.engine_hf import HfBaselines

        self.args = args
        self.workload = make_workload(spec)
        longest = max(
            len(self.workload.prompt_ids(i)) + self.workload.max_tokens[i]
            for i in range(len(self.workload))
        )
        self.settings = engine_settings(checkpoint, longest, max(args.concurrency), args.threads)
        self.built = build_engine(self.settings)
        self.hf: HfBaselines | None = None
        self.hf_refused: str | None = None
        try:
            self.hf = HfBaselines(checkpoint, self.built.model.dtype)
        except Exception as exc:  # a checkpoint transformers refuses: measure ours alone
            self.hf_refused = f"{type(exc).__name__}: {str(exc).splitlines()[-1].strip()}"
        # transformers runs on one worker thread, as the engine does on its own: libgomp's
        # workers behave differently for the main thread (measured 7x slower steps there).
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf")
        self.samples: dict[tuple[str, int], list[Summary]] = {}
        self.outputs: dict[tuple[str, int], list[Trace]] = {}

    async def _on_worker(self, fn: Callable[..., _T], *fn_args: object) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *fn_args)

    def _add(self, system: str, c: int, traces: list[Trace], note: str) -> None:
        self.samples.setdefault((system, c), []).append(summarize(system, c, traces, note))
        self.outputs.setdefault((system, c), traces)

    async def warm_up(self) -> None:
        from bench.engine_ours import serve_engine

        if self.hf is not None:
            await self._on_worker(self.hf.warm_up, self.workload)
        self.built.engine.start()
        await serve_engine(self.built.engine, self.workload.head(4, 8), 4, "warm-up")

    async def run_round(self, rnd: int) -> None:
        from bench.engine_hf import serial_closed_loop
        from bench.engine_ours import serve_engine

        for system, c in round_plan(self.args.concurrency, rnd, with_hf=self.hf is not None):
            if system == OURS:
                traces = await serve_engine(self.built.engine, self.workload, c, f"r{rnd}c{c}")
                self._add(OURS, c, traces, "AsyncEngine, in-process")
            elif system == SERIAL and self.hf is not None:
                start, served = await self._on_worker(self.hf.serial, self.workload)
                for cc in self.args.concurrency:
                    traces = serial_closed_loop(start, served, cc)
                    self._add(SERIAL, cc, traces, "generate() per request")
                    if cc == 1:
                        self._add(STATIC, cc, traces, "= serial (batch of 1)")
            elif self.hf is not None:
                static = await self._on_worker(self.hf.static, self.workload, c)
                self._add(STATIC, c, static, f"generate() per batch of {c}")


async def measure_model(
    name: str, checkpoint: Path, spec: WorkloadSpec, args: argparse.Namespace
) -> tuple[ModelResult, LlamaModel]:
    """Every system at every concurrency on one checkpoint; returns the result and our model."""
    session = _Session(checkpoint, spec, args)
    await session.warm_up()
    for rnd in range(args.rounds):
        await session.run_round(rnd)
    session.worker.shutdown()
    result = collect(name, session.samples, session.outputs, args.concurrency)
    if session.hf_refused is not None:
        result.notes.append(f"transformers cannot load this checkpoint ({session.hf_refused})")
    if args.http:
        engine, settings, workload = session.built.engine, session.settings, session.workload
        result.rows.append(await measure_http(engine, settings, workload, args))
    await session.built.engine.stop()
    return result, session.built.model


async def measure_http(
    engine: AsyncEngine, settings: BackendSettings, workload: Workload, args: argparse.Namespace
) -> Summary:
    """Through the HTTP server, between two in-process runs of the same workload (A B A), so the
    overhead is measured against its neighbours rather than against rounds run long before."""
    from bench.engine_ours import serve_engine, serve_http

    c = max(args.concurrency)
    before = summarize(OURS, c, await serve_engine(engine, workload, c, "http-before"))
    http = summarize(HTTP, c, await serve_http(settings, workload, c))
    after = summarize(OURS, c, await serve_engine(engine, workload, c, "http-after"))
    in_process = (before.tokens_per_s + after.tokens_per_s) / 2
    note = (
        f"HTTP /v1/completions SSE, in-process server; in-process runs just before/after: "
        f"{in_process:,.1f} tok/s, HTTP/in-process {http.tokens_per_s / in_process:.2f}x"
    )
    return replace(http, note=note)


def collect(
    name: str,
    samples: dict[tuple[str, int], list[Summary]],
    outputs: dict[tuple[str, int], list[Trace]],
    concurrencies: Sequence[int],
) -> ModelResult:
    """Median of the rounds per (system, concurrency), and whether the greedy tokens agree."""
    result = ModelResult(name)
    for c in concurrencies:
        systems = [k for k in (OURS, SERIAL, STATIC) if (k, c) in samples]
        result.rows += [median_summary(samples[(k, c)]) for k in systems]
        # the serial run's tokens do not depend on c
        serial = outputs.get((SERIAL, concurrencies[0]))
        if serial is not None:
            same = same_outputs(outputs[(OURS, c)], serial)
            result.notes.append(
                f"c={c}: greedy tokens identical to hf serial for {same}/{len(serial)}"
            )
    return result


def _ratio_cells(ours: Summary | None, row: Summary) -> tuple[str, str, str]:
    if ours is None or row.system in (OURS, HTTP):  # HTTP: compared with its neighbours (note)
        return "", "", ""
    return (
        f"{ours.tokens_per_s / row.tokens_per_s:.2f}x",
        f"{ours.ttft_p50_ms / row.ttft_p50_ms:.2f}x",
        f"{ours.tpot_p50_ms / row.tpot_p50_ms:.2f}x",
    )


TABLE_HEAD = (
    "conc", "system", "tok/s", "TTFT p50 ms", "tok lat p50 ms", "tokens", "wall s",
    "ours/this tok/s", "ours/this TTFT", "ours/this tok lat", "what",
)  # fmt: skip


def table_rows(result: ModelResult) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for r in result.rows:
        cells = _ratio_cells(result.row(OURS, r.concurrency), r)
        rows.append(
            (
                str(r.concurrency),
                r.system,
                f"{r.tokens_per_s:,.1f}",
                f"{r.ttft_p50_ms:,.0f}",
                f"{r.tpot_p50_ms:.1f}",
                str(r.tokens),
                f"{r.wall_s:.1f}",
                *cells,
                r.note,
            )  # fmt: skip
        )
    return rows


def print_table(result: ModelResult) -> None:
    rows = [TABLE_HEAD, *table_rows(result)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEAD))]
    for n, row in enumerate(rows):
        cells = [
            c.ljust(w) if i in (1, 10) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
        if n == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for note in result.notes:
        print(f"  {note}")


def check_goals(result: ModelResult, concurrencies: Sequence[int]) -> list[tuple[str, bool]]:
    goals = []
    for c in concurrencies:
        ours = result.row(OURS, c)
        for system in (SERIAL, STATIC):
            base = result.row(system, c)
            if ours is None or base is None:
                continue
            ratio = ours.tokens_per_s / base.tokens_per_s
            need = GOAL_AT_32 if c == 32 else 1.0
            text = f"{result.name} c={c}: kvguard/{system} tok/s = {ratio:.2f}x (goal > {need:g}x)"
            met = ratio > need if need == 1.0 else ratio >= need
            goals.append((text, met))
            measure = f"tok/s at {c} clients, kvguard / transformers {system} ({result.name})"
            emit("engine", measure, f"{ratio:.2f}x", f"> {need:g}x", met)
    return goals


def write_markdown(
    path: Path, header: Sequence[str], results: Sequence[ModelResult], tail: Sequence[str]
) -> None:
    lines = [*header, ""]
    for result in results:
        lines += [f"### {result.name}", "", "| " + " | ".join(TABLE_HEAD) + " |"]
        lines.append("|" + "---|" * len(TABLE_HEAD))
        lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
        lines += ["", *(f"- {n}" for n in result.notes), ""]
    lines += list(tail)
    path.write_text("\n".join(lines) + "\n")


def fit_spec(spec: WorkloadSpec, checkpoint: Path) -> WorkloadSpec:
    """Shrink the workload's lengths to a model whose window is smaller than the longest request."""
    import json

    window = int(json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"])
    longest = spec.prompt_range[1] + spec.output_range[1]
    if longest <= window:
        return spec
    scale = window / longest
    (p_lo, p_hi), (o_lo, o_hi) = spec.prompt_range, spec.output_range
    prompts = (min(p_lo, int(p_hi * scale)), int(p_hi * scale))
    outputs = (min(o_lo, int(o_hi * scale)), int(o_hi * scale))
    return WorkloadSpec(spec.requests, prompts, outputs, spec.seed)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload (under ~2 min)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--repeats", type=int, help="isolation runs per config (default 5, quick 3)"
    )
    parser.add_argument("--rounds", type=int, help="rounds of every system (default 2, quick 1)")
    parser.add_argument("--no-http", dest="http", action="store_false", help="skip the HTTP run")
    parser.add_argument("--no-bundled", dest="bundled", action="store_false")
    parser.add_argument(
        "--checkpoint", type=Path, action="append", default=[], help="also benchmark this dir"
    )
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 4)
    args.rounds = args.rounds or (1 if args.quick else 2)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = QUICK if args.quick else FULL
    import transformers

    main_threads, engine_threads = thread_counts()
    header = [
        f"command: python -m bench.bench_engine {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"machine: {machine()}",
        f"torch {torch.__version__}, transformers {transformers.__version__}, torch threads "
        f"{main_threads} (engine thread sees {engine_threads}), fp32, greedy",
        f"workload: {spec.describe()}; closed loop: C clients, each sends its next request when "
        "the previous one is complete; TTFT counts queueing",
        "load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
    ]
    print("\n".join(header), flush=True)
    results, goals = [], []
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-") as tmp:
        checkpoint = Path(tmp) / "random-llama"
        params = write_random_checkpoint(checkpoint, SHAPE, seed=0)
        random_name = f"random-{params / 1e6:.0f}M"
        header.append(
            f"{random_name}: random Llama, {params / 1e6:.1f}M params, {SHAPE.describe()}"
        )
        print(header[-1])
        models = [(random_name, checkpoint)]
        if args.bundled and BUNDLED.is_dir():
            models.append(("kvguard-tiny", BUNDLED))
        models += [(path.name, path) for path in args.checkpoint]
        random_model: LlamaModel | None = None
        for name, path in models:
            started = time.monotonic()
            result, model = asyncio.run(measure_model(name, path, fit_spec(spec, path), args))
            if random_model is None:  # the isolation runs use the first (random) model
                random_model = model
            print(f"\n{name} ({time.monotonic() - started:.0f} s)")
            print_table(result)
            results.append(result)
            goals += check_goals(result, args.concurrency)
        iso_spec = ISO_QUICK if args.quick else ISO_FULL
        assert random_model is not None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="iso") as pool:
            # on a worker thread, like the engine loop (see measure_model)
            job = pool.submit(measure_isolation, random_model, iso_spec, args.repeats)
            iso = job.result()
    iso_lines, iso_goals = isolation_report(iso, iso_spec)
    print("\n" + "\n".join(iso_lines))
    goals += iso_goals
    load_end = "load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(f"\n{load_end}")
    print("\nratios: ours/this; > 1x tok/s and < 1x latency mean kvguard is better")
    for text, ok in goals:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    if args.markdown:
        verdicts = [f"- {'PASS' if ok else 'FAIL'} {t}" for t, ok in goals]
        tail = [*iso_lines, "", load_end, "", "Goals:", "", *verdicts]
        write_markdown(args.markdown, header, results, tail)
    return 0 if all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
