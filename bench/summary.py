"""Headline numbers: how each benchmark reports its side-by-side ratios to ``bench.run``.

A benchmark prints its own detailed tables, and for each headline comparison calls ``emit``,
which prints one machine-readable line (``SUMMARY_PREFIX`` + JSON). ``bench.run`` runs every
benchmark as its own process, ``parse``s those lines from its output and prints them all as one
table (``table``): the performance report (``docs/benchmarks.md``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

SUMMARY_PREFIX = "@@kvguard-summary "


@dataclass(frozen=True, slots=True)
class Headline:
    """One comparison measured side by side in the same run."""

    benchmark: str
    measure: str  # what was compared, e.g. "tok/s at 32 clients, kvguard / transformers serial"
    value: str  # the measured ratio or number, formatted, e.g. "4.58x" or "-0.40%"
    goal: str = ""  # e.g. "> 3x"; empty when the number is reported without a goal
    met: bool | None = None  # None when there is no goal


def emit(
    benchmark: str, measure: str, value: str, goal: str = "", met: bool | None = None
) -> Headline:
    """Print one headline line for ``bench.run`` (and return it)."""
    headline = Headline(benchmark, measure, value, goal, met)
    print(SUMMARY_PREFIX + json.dumps(asdict(headline)), flush=True)
    return headline


def parse(output: str) -> list[Headline]:
    """The headlines a benchmark printed; lines that are not headlines are ignored."""
    found = []
    for line in output.splitlines():
        if line.startswith(SUMMARY_PREFIX):
            found.append(Headline(**json.loads(line[len(SUMMARY_PREFIX) :])))
    return found


def without_headlines(output: str) -> str:
    """The benchmark's own output, minus the machine-readable headline lines."""
    return "\n".join(x for x in output.splitlines() if not x.startswith(SUMMARY_PREFIX))


def table(headlines: Iterable[Headline]) -> str:
    """All headlines as one Markdown table."""
    rows = ["| benchmark | measured side by side | result | goal | |", "|---|---|---|---|---|"]
    for h in headlines:
        verdict = "" if h.met is None else ("met" if h.met else "**missed**")
        rows.append(f"| {h.benchmark} | {h.measure} | {h.value} | {h.goal} | {verdict} |")
    return "\n".join(rows)


def missed(headlines: Sequence[Headline]) -> list[Headline]:
    return [h for h in headlines if h.met is False]
