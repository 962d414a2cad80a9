"""The relay benchmark's report: its tables, its goals, its headlines, and the page section.

``report(...)`` turns ``bench.bench_relay``'s outcomes into Markdown (what
``bench/results/relay.md`` holds) and emits the ``bench.summary`` headlines.
``python -m bench.relay_report`` copies that file, the server-layer candidates
``bench.relay_candidates`` measured (``bench/results/relay-candidates.md``) and the profile
``bench.relay_profile`` wrote (``bench/results/relay-profile.md``), into the benchmark page
(``docs/benchmarks.md``)
between the ``relay-report`` markers
(``--check``: exit 1 if the page differs), so that section is generated, never edited by hand.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.report_page import splice
from bench.run import commit, cpu_model
from bench.summary import emit

GATEWAY = "kvguard gateway"
LITELLM = "LiteLLM proxy"
NAIVE = "aiohttp pass-through"
CHECKS_OFF = "kvguard pump, checks off"  # bench.relay_systems.PUMP_NO_CHECKS
LEAN = "lean asyncio relay"
# Issue 33's goals: ratios to the aiohttp pass-through measured in the same round, every check on.
GOAL_EVENT_RATIO = 1.0
GOAL_REQUEST_RATIO = 2.0
GOAL_LITELLM_RATIO = 15.0
GOAL_ADDED_P99_MS = 5.0
GOAL_ADDED_RATE = 500
# The stated bound on an event's added delay: the stand-in's interval between events (10 ms), so
# the relay never holds an event past the moment the next one is due.
GOAL_EVENT_DELAY_MS = 10.0
REPO = Path(__file__).resolve().parent.parent
PAGES = (REPO / "docs" / "benchmarks.md",)  # the first with the markers
RESULTS = REPO / "bench" / "results" / "relay.md"
PROFILE = REPO / "bench" / "results" / "relay-profile.md"
CANDIDATES = REPO / "bench" / "results" / "relay-candidates.md"  # bench.relay_candidates
BEGIN, END = "<!-- relay-report:begin -->", "<!-- relay-report:end -->"


@dataclass(frozen=True, slots=True)
class Max:
    """The largest rate that met the latency bound. ``bounded_by_load``: the load side ran out
    first, so the relay's own limit is at least ``rate``; ``below``: even this lowest rate tried
    missed the bound (``rate`` is 0)."""

    rate: float
    bounded_by_load: bool = False
    below: float | None = None

    def text(self) -> str:
        if self.below is not None:
            return f"< {self.below:,.0f}"
        return f"{'>= ' if self.bounded_by_load else ''}{self.rate:,.0f}"

    def scaled(self, factor: float) -> Max:
        below = None if self.below is None else self.below * factor
        return Max(self.rate * factor, self.bounded_by_load, below)


@dataclass
class Outcome:
    """Everything measured for one system."""

    name: str
    request_us: list[float] = field(default_factory=list)  # per round
    event_us: list[float] = field(default_factory=list)
    errors: int = 0
    max_requests: Max | None = None
    max_events: Max | None = None
    added: dict[int, tuple[float, float, int]] = field(default_factory=dict)  # p50, p99, errors
    # per round: how much later than through no relay a streamed answer's last event came, p50
    # and p99 (the last event carries any text the firewall held back)
    event_delay_ms: list[tuple[float, float]] = field(default_factory=list)
    growth: dict[str, list[float]] = field(default_factory=dict)  # label -> µs/request per round


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def spread(values: list[float], digits: int = 0) -> str:
    """The median, and min-max over rounds when there were several."""
    if not values:
        return "-"
    mid = f"{median(values):,.{digits}f}"
    if len(values) == 1:
        return mid
    return f"{mid} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def main_table(outcomes: list[Outcome], rates: tuple[int, ...]) -> str:
    head = (
        "| system | CPU µs / request | CPU µs / streamed event | max req/s (p99 < 50 ms) "
        "| max events/s (p99 < 50 ms) | last event added p50 / p99 ms | "
        + " | ".join(f"added p50 / p99 ms at {r:,}/s" for r in rates)
        + " |"
    )
    rows = [head, "|" + "---|" * (6 + len(rates))]
    for out in outcomes:
        cells = [
            out.name,
            spread(out.request_us),
            spread(out.event_us, 1),
            out.max_requests.text() if out.max_requests else "-",
            out.max_events.text() if out.max_events else "-",
            _delay(out),
        ]
        for rate in rates:
            got = out.added.get(rate)
            if got is None:
                cells.append("not reached")
            else:
                errors = f", {got[2]} errors" if got[2] else ""
                cells.append(f"{got[0]:.2f} / {got[1]:.2f}{errors}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _delay(out: Outcome) -> str:
    if not out.event_delay_ms:
        return "-"
    p50 = median([d[0] for d in out.event_delay_ms])
    return f"{p50:.2f} / {median([d[1] for d in out.event_delay_ms]):.2f}"


def growth_table(outcomes: list[Outcome]) -> str:
    rows = ["| system | measured | CPU µs / request | vs the group's first row |"]
    rows.append("|---|---|---|---|")
    for out in outcomes:
        for group in _groups(out):
            base = median(out.growth[group[0]])
            for label in group:
                value = median(out.growth[label])
                versus = "-" if label == group[0] else f"{(value / base - 1) * 100:+.0f}%"
                rows.append(f"| {out.name} | {label} | {spread(out.growth[label])} | {versus} |")
    return "\n".join(rows)


def _groups(out: Outcome) -> list[list[str]]:
    """The growth labels by dimension, in the order measured."""
    groups = []
    for word in ("tenants", "engine", "prompt"):
        group = [label for label in out.growth if word in label]
        if group:
            groups.append(group)
    return groups


def growth(out: Outcome, group: str) -> tuple[float, float] | None:
    """(first, last) medians of a growth group (e.g. "tenants")."""
    labels = [label for label in out.growth if group in label]
    if len(labels) < 2:
        return None
    return median(out.growth[labels[0]]), median(out.growth[labels[-1]])


def round_ratios(ours: list[float], base: list[float]) -> list[float]:
    """Per round: ours / the base's of the same round (the systems of a round share its load)."""
    return [a / b for a, b in zip(ours, base, strict=False) if b]


def goals(outcomes: dict[str, Outcome], tenants: int) -> tuple[str, bool]:
    """The goals table, and whether every evaluated goal is met (headlines emitted)."""
    rows = ["| goal (issue 33) | measured | |", "|---|---|---|"]
    all_met = True

    def row(goal: str, measured: str, met: bool | None) -> None:
        nonlocal all_met
        verdict = "not measured" if met is None else ("met" if met else "**missed**")
        rows.append(f"| {goal} | {measured} | {verdict} |")
        all_met &= met is not False

    gw, naive = outcomes.get(GATEWAY), outcomes.get(NAIVE)
    if gw is None:
        return "\n".join(rows), True
    event, request = median(gw.event_us), median(gw.request_us)
    for unit, ours, goal_ratio in (
        ("streamed event", gw.event_us, GOAL_EVENT_RATIO),
        ("non-streaming request", gw.request_us, GOAL_REQUEST_RATIO),
    ):
        what = f"kvguard CPU per {unit} / the aiohttp pass-through's, same round"
        goal = f"<= {goal_ratio:.1f}x"
        if naive is None:
            row(f"{what} {goal}", "-", None)
            continue
        streamed = unit == "streamed event"
        base = naive.event_us if streamed else naive.request_us
        ratios = round_ratios(ours, base)
        met = bool(ratios) and median(ratios) <= goal_ratio
        shown = f"{spread(ratios, 2)}x"
        floor = outcomes.get(CHECKS_OFF)
        if floor is not None:  # the same pump with every check off, beside it
            off = round_ratios(floor.event_us if streamed else floor.request_us, base)
            shown += f"; the same pump, every check off: {spread(off, 2)}x"
        row(f"{what} {goal}", shown, met)
        emit("relay", what, shown, goal, met)
    for floor in (NAIVE, LEAN):
        base_outcome = outcomes.get(floor)
        if base_outcome is not None:
            emit(
                "relay",
                f"kvguard / {floor} CPU per streamed event; per request",
                f"{event / median(base_outcome.event_us):.2f}x; "
                f"{request / median(base_outcome.request_us):.2f}x",
            )
    litellm_row(gw, outcomes.get(LITELLM), row)
    added = gw.added.get(GOAL_ADDED_RATE)
    goal = f"< {GOAL_ADDED_P99_MS:.0f} ms"
    what = f"gateway-added p99 at {GOAL_ADDED_RATE}/s non-streaming"
    if added is None:
        row(f"{what} {goal}", "rate not reached", False)
        emit("relay", what, "not reached", goal, False)
    else:
        met = added[1] < GOAL_ADDED_P99_MS and added[2] == 0
        row(f"{what} {goal}", f"{added[1]:.2f} ms", met)
        emit("relay", what, f"{added[1]:.2f} ms", goal, met)
    if gw.event_delay_ms:
        delay = median([d[1] for d in gw.event_delay_ms])
        goal = f"<= {GOAL_EVENT_DELAY_MS:.0f} ms (one event interval)"
        what = "added delay of a streamed answer's last event, p99 (the stated bound)"
        met = delay <= GOAL_EVENT_DELAY_MS
        row(f"{what} {goal}", f"{delay:.2f} ms", met)
        emit("relay", what, f"{delay:.2f} ms", goal, met)
    pair = growth(gw, "tenants")
    if pair is not None:  # issue 23's goal (<= 10%), shown, not judged here
        change = pair[1] / pair[0] - 1
        what = f"CPU per request growth, 10 -> {tenants:,} tenants (issue 23; informative)"
        rows.append(f"| {what} | {change * 100:+.0f}% | - |")
    return "\n".join(rows), all_met


def litellm_row(gw: Outcome, proxy: Outcome | None, row: Callable[..., None]) -> None:
    """Max streamed events/s, kvguard / LiteLLM. A side whose load generator ran out first has
    only a lower bound (``>=``): the ratio is then a bound too, and a goal it cannot decide is
    not evaluated. The CPU-cost ratio (what one core sustains when CPU-bound) is shown with it."""
    goal = f">= {GOAL_LITELLM_RATIO:.0f}x"
    what = "max streamed events/s on one core, kvguard / LiteLLM proxy"
    ours, theirs = gw.max_events, proxy.max_events if proxy is not None else None
    if proxy is None or ours is None or theirs is None or not (theirs.rate or theirs.below):
        row(f"{what} {goal}", "-", None)
        return
    ratio = ours.rate / (theirs.rate or theirs.below or 1.0)
    at_least = ours.bounded_by_load or theirs.below is not None
    at_most = theirs.bounded_by_load
    met: bool | None = ratio >= GOAL_LITELLM_RATIO
    if at_least and at_most:
        bound, met = "?", None
    elif at_least:
        bound, met = ">= ", True if met else None
    elif at_most:
        bound, met = "<= ", None if met else False
    else:
        bound = ""
    cpu = median(proxy.event_us) / median(gw.event_us)
    shown = f"{bound}{ratio:.1f}x ({ours.text()} / {theirs.text()}); CPU per event {cpu:.1f}x less"
    row(f"{what} {goal}", shown, met)
    emit("relay", what, shown, goal, met)


def report(
    args: argparse.Namespace,
    outcomes: list[Outcome],
    *,
    load: tuple[tuple[float, ...], tuple[float, ...]],
    missing_litellm: str | None,
    argv: list[str] | None = None,
) -> tuple[str, bool]:
    from bench.bench_relay import INTERVAL_S, RATES, TOKENS

    by_name = {out.name: out for out in outcomes}
    goal_text, met = goals(by_name, args.tenants)
    invoked = shlex.join(
        ["python", "-m", "bench.bench_relay", *(argv if argv is not None else sys.argv[1:])]
    )
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "### Relay cost: kvguard gateway vs the floors vs LiteLLM proxy",
        "",
        f"- Command: `{invoked}` at commit {commit()}, {started}",
        f"- Machine: {cpu_model()}; each relay pinned to CPU 0, the load generator, the engine "
        "stand-in, Redis and PostgreSQL on CPU 1",
        f"- Load average (1 / 5 / 15 min) before: {_load(load[0])}; after: {_load(load[1])} "
        "(other work on the machine shares both cores: CPU per unit is robust to it, latency "
        "is not)",
        f"- Workload: chat completions, {TOKENS}-token answers ({TOKENS + 3} SSE events, one "
        f"every {INTERVAL_S * 1000:.0f} ms); CPU per request at {args.cost_rate:.0f} requests/s, "
        f"per event at {args.stream_rate:.0f} streams/s (and, at that rate, how much later "
        "than through no relay the last event of an answer came); "
        f"{args.rounds} rounds (median, min-max); 10 active tenants, the canary marks "
        f"{args.canary_rate * 100:.0f}% of their requests",
        "",
        main_table(outcomes, RATES),
        "",
        "How the CPU per non-streaming request grows (prompts at "
        f"{args.prompt_rate:.0f} requests/s, the rest at {args.cost_rate:.0f}):",
        "",
        growth_table(outcomes),
        "",
        goal_text,
    ]
    if missing_litellm is not None:
        lines += ["", f"LiteLLM proxy not measured: {missing_litellm[:500]}"]
    return "\n".join(lines), met


def _load(values: tuple[float, ...]) -> str:
    return " / ".join(f"{x:.1f}" for x in values)


# ---- the benchmark page's section ---------------------------------------------------------


def page() -> Path:
    """The page that holds the section: the first of ``PAGES`` with the begin marker."""
    for candidate in PAGES:
        if candidate.is_file() and BEGIN in candidate.read_text(encoding="utf-8"):
            return candidate
    raise FileNotFoundError(f"no page holds {BEGIN} (looked in {', '.join(map(str, PAGES))})")


def section(results: Path = RESULTS, profile: Path = PROFILE, candidates: Path = CANDIDATES) -> str:
    parts = [results.read_text(encoding="utf-8").strip()]
    for extra in (candidates, profile):
        if extra.is_file():
            parts.append(extra.read_text(encoding="utf-8").strip())
    return BEGIN + "\n" + "\n\n".join(parts) + "\n" + END


def update(target: Path | None = None) -> bool:
    """Write the section into the page; True if it changed."""
    target = target or page()
    text = target.read_text(encoding="utf-8")
    new = splice(text, BEGIN, END, section())
    if new != text:
        target.write_text(new, encoding="utf-8")
    return new != text


def refresh_page() -> None:
    """After a run of record: the page shows its results (or one line says why it cannot)."""
    try:
        target = page()
        print(f"{target} {'updated' if update(target) else 'already current'}")
    except (FileNotFoundError, ValueError) as exc:
        print(f"benchmark page not updated: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="copy bench/results/relay*.md into the benchmark page"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    target = page()
    if args.check:
        stale = section() not in target.read_text(encoding="utf-8")
        if stale:
            print(f"{target} is stale: run python -m bench.relay_report", file=sys.stderr)
        return 1 if stale else 0
    print(f"{target} updated" if update(target) else f"{target} already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
