"""Run every benchmark in ``bench/`` one after another and collect their tables.

``python -m bench.run [--only NAME ...]`` (or ``make bench``) runs each ``bench_*.py`` module as
its own process (so one benchmark's threads and allocations do not colour the next), prints
its table as it finishes, and writes everything to ``bench/results/latest.md`` with the machine
it ran on. Exit status is non-zero if any benchmark failed or missed its goal.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "latest.md"


def discover() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))


def machine() -> str:
    cpus = os.cpu_count() or 0
    return f"{platform.machine()}, {cpus} CPUs, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="benchmark module names (default: all)")
    args = parser.parse_args(argv)
    names = args.only or discover()
    sections = [f"# kvguard benchmarks\n\nMachine: {machine()}\n"]
    failed: list[str] = []
    for name in names:
        print(f"== {name}", flush=True)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", f"bench.{name}"], capture_output=True, text=True, check=False
        )
        took = time.monotonic() - started
        print(result.stdout, flush=True)
        if result.returncode != 0:
            failed.append(name)
            print(result.stderr[-3000:], file=sys.stderr)
        status = "ok" if result.returncode == 0 else f"exit {result.returncode}"
        block = f"## {name} ({status}, {took:.0f} s)\n\n```\n{result.stdout.strip()}\n```\n"
        sections.append(block)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join(sections))
    print(f"wrote {RESULTS}")
    if failed:
        print(f"failed or missed their goal: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
