"""Run every benchmark in ``bench/`` one after another: the performance report.

``python -m bench.run [--quick] [--only NAME ...]`` (or ``make bench``, or ``kvguard bench``) runs
each ``bench_*.py`` module as its own process (so one benchmark's threads and allocations do not
colour the next), prints its tables as it finishes, then prints one table of every headline
comparison (``bench.summary``: each measured side by side in the same run), and writes it all to
``bench/results/latest.md`` with the machine it ran on. ``--quick`` passes ``--quick`` to the
benchmarks that have a smaller workload. Exit status is non-zero if any benchmark failed or
missed its goal.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench.summary import Headline, parse, table, without_headlines

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "latest.md"
# the benchmarks that offer a smaller --quick workload
HAS_QUICK = frozenset({"bench_engine", "bench_disagg", "bench_load", "bench_proxy"})


def discover() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))


def machine() -> str:
    cpus = os.cpu_count() or 0
    return f"{platform.machine()}, {cpus} CPUs, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="benchmark module names (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads where offered")
    args = parser.parse_args(argv)
    names = args.only or discover()
    sections: list[str] = []
    headlines: list[Headline] = []
    failed: list[str] = []
    for name in names:
        print(f"== {name}", flush=True)
        started = time.monotonic()
        command = [sys.executable, "-m", f"bench.{name}"]
        if args.quick and name in HAS_QUICK:
            command.append("--quick")
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
    head = f"# kvguard benchmarks\n\nMachine: {machine()}\n\n## Headlines\n\n{summary}\n"
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join([head, *sections]))
    print(f"wrote {RESULTS}")
    if failed:
        print(f"failed or missed their goal: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
