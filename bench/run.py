"""Run every benchmark in ``bench/`` one after another: the performance report.

``python -m bench.run [--quick] [--only NAME ...]`` (or ``make bench``, or ``kvguard bench``) runs
each ``bench_*.py`` module as its own process (so one benchmark's threads and allocations do not
colour the next), prints its tables as it finishes, then prints one table of every headline
comparison (``bench.summary``: each measured side by side in the same run), and writes it all to
``bench/results/latest.md`` (committed; ``docs/benchmarks.md`` shows its table through
``bench.report_page``) with what it ran on: CPU model and count, load average before and after
(the benchmarks compare side by side in the same run, so ratios survive a busy machine; absolute
numbers do not), torch and Python versions, the commit (``+dirty`` when the tree had changes)
and the command. ``--quick`` passes ``--quick`` to the benchmarks that have a smaller workload.
Exit status is non-zero if any benchmark failed or missed its goal.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from bench import report_page
from bench.summary import Headline, parse, table, without_headlines

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "latest.md"
# the benchmarks that offer a smaller --quick workload
HAS_QUICK = frozenset(
    {
        "bench_engine",
        "bench_disagg",
        "bench_handoff",
        "bench_kvcache",
        "bench_load",
        "bench_proxy",
        "bench_relay",
        "bench_canary_answers",
        "bench_structured",
    }
)
# benchmarks run more than once, with these arguments (full, quick); every other runs once, plain
RUNS: dict[str, tuple[list[list[str]], list[list[str]]]] = {
    # gateway vs direct at the goal's rate, then the leak firewall's share of the gateway's CPU
    # (LiteLLM's proxy is compared with the gateway in bench_proxy)
    "bench_gateway": (
        [["--skip-litellm"], ["--firewall-cpu"]],
        [
            ["--skip-litellm", "--rates", "100", "--seconds", "10", "--rounds", "2"],
            ["--firewall-cpu"],
        ],
    ),
}


def discover() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))


def runs(name: str, quick: bool) -> list[list[str]]:
    """The argument lists ``name`` runs with."""
    if name in RUNS:
        full, small = RUNS[name]
        return small if quick else full
    return [["--quick"] if quick and name in HAS_QUICK else []]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def commit() -> str:
    """The checked-out commit, ``+dirty`` when tracked files (other than results) differ."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # bench/results/ holds what the benchmarks write: a run before this one leaves it changed
    changed = git(
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ":(top)",
        ":(top,exclude)bench/results",
    )
    return head + ("+dirty" if changed else "")


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def machine() -> str:
    cpus = os.cpu_count() or 0
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return (
        f"{platform.machine()}, {cpus} CPUs ({cpu_model()}), torch {torch}, "
        f"Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="benchmark module names (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads where offered")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"report file (default {RESULTS})"
    )
    args = parser.parse_args(argv)
    names = args.only or discover()
    unknown = sorted(set(names) - set(discover()))
    if unknown:
        parser.error(
            f"no such benchmark: {', '.join(unknown)} (choose from {', '.join(discover())})"
        )
    started_at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before, begun, at_commit = load_average(), time.monotonic(), commit()
    sections: list[str] = []
    headlines: list[Headline] = []
    failed: list[str] = []
    for name, extra in ((n, e) for n in names for e in runs(n, args.quick)):
        command = [sys.executable, "-m", f"bench.{name}", *extra]
        print(f"== {' '.join(command[2:])}", flush=True)
        started = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        took = time.monotonic() - started
        own = without_headlines(result.stdout).strip()
        print(own, flush=True)
        headlines += parse(result.stdout)
        if result.returncode != 0:
            failed.append(name)
            print(result.stderr[-3000:], file=sys.stderr)
        status = "ok" if result.returncode == 0 else f"exit {result.returncode}"
        shown = " ".join(command[2:])
        sections.append(
            f"## {name} (`python -m {shown}`, {status}, {took:.0f} s)\n\n```\n{own}\n```\n"
        )
    summary = table(headlines)
    print(f"\n{summary}\n")
    invoked = shlex.join(
        ["python", "-m", "bench.run", *(argv if argv is not None else sys.argv[1:])]
    )
    head = (
        f"# kvguard benchmarks\n\n"
        f"- Command: `{invoked}` at commit {at_commit}, started {started_at}, "
        f"took {(time.monotonic() - begun) / 60:.1f} min\n"
        f"- Machine: {machine()}\n"
        f"- Load average (1 / 5 / 15 min) before: {load_before}; after: {load_average()}\n\n"
        f"## Headlines\n\n{summary}\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join([head, *sections]))
    print(f"wrote {args.out}")
    report_page.refresh_for(args.out)
    if failed:
        print(f"failed or missed their goal: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
