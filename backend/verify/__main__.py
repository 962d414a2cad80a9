"""``python -m backend.verify [--bound small|large] [--fault NAME ...]``.

Explores each instance of the bound, prints states, time and PASS or the counterexample; exits 1
if any instance fails.
"""

from __future__ import annotations

import argparse
import sys

from backend.disagg.faults import Fault, FaultSet
from backend.verify.bounds import BOUNDS
from backend.verify.explore import Report, check


def render(report: Report) -> str:
    faults = ", ".join(report.faults) or "none"
    head = (
        f"bound {report.bound} (faults: {faults}): {report.states} states, "
        f"{report.transitions} transitions, {report.seconds:.1f} s: "
    )
    if report.passed:
        return head + "PASS"
    lines = [head + f"FAIL {report.violated}: {report.problem}", "counterexample:"]
    for number, step in enumerate(report.trace):
        lines.append(f"{number:3d}. {step.label}")
        lines.append(step.picture)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.verify", description=__doc__)
    parser.add_argument("--bound", choices=sorted(BOUNDS), default="small")
    parser.add_argument("--fault", action="append", default=[], choices=[f.value for f in Fault])
    args = parser.parse_args(argv)
    faults = FaultSet(frozenset(Fault(name) for name in args.fault))
    failed = False
    for bound in BOUNDS[args.bound]:
        report = check(bound, faults)
        print(render(report), flush=True)
        failed = failed or not report.passed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
