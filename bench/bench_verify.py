"""The model checker at the large bound: states explored and time per instance, and the verdict.

.venv/bin/python -m bench.bench_verify [--bound large|small]   (from the repo root)
"""

from __future__ import annotations

import argparse
import sys

from backend.verify import BOUNDS, check
from bench.summary import emit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.bench_verify")
    parser.add_argument("--bound", choices=sorted(BOUNDS), default="large")
    args = parser.parse_args(argv)
    print(f"{'instance':16s} {'states':>9s} {'transitions':>12s} {'seconds':>8s}  verdict")
    failed = False
    for bound in BOUNDS[args.bound]:
        report = check(bound)
        verdict = "PASS" if report.passed else f"FAIL {report.violated}: {report.problem}"
        print(
            f"{bound.name:16s} {report.states:9d} {report.transitions:12d} "
            f"{report.seconds:8.1f}  {verdict}",
            flush=True,
        )
        failed = failed or not report.passed
        emit(
            "verify",
            f"model checker, {bound.name}: states explored, safety properties",
            f"{report.states:,} states in {report.seconds:.0f} s",
            "all hold",
            report.passed,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
