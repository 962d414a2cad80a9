"""`kvguard bench`: the performance report (every benchmark in `bench/`, one table of ratios).

The benchmarks live in the source checkout, not in the installed package (they need the
baselines' heavy dependencies and write `bench/results/`), so the command runs `python -m
bench.run` from the checkout this package was installed from, and says so clearly when there
is none.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run every benchmark in bench/ and print one table of side-by-side ratios",
        description=__doc__,
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads where offered")
    parser.add_argument("--only", nargs="*", metavar="NAME", help="bench_* module names")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if not (CHECKOUT / "bench" / "run.py").is_file():
        print(
            f"kvguard bench needs the source checkout (bench/ next to {CHECKOUT / 'kvguard'}); "
            "this installation has none",
            file=sys.stderr,
        )
        return 2
    command = [sys.executable, "-m", "bench.run"]
    if args.quick:
        command.append("--quick")
    if args.only:
        command += ["--only", *args.only]
    return subprocess.run(command, cwd=CHECKOUT, check=False).returncode
