"""Two versions of the gateway side by side: CPU per request and per streamed event, A vs B.

Run: ``python -m bench.relay_ab A_CHECKOUT B_CHECKOUT [--rounds 5] [--seconds 5]``, e.g.
``python -m bench.relay_ab /work/main .`` to see what a change does before it lands. Both
gateways run (pinned, production mode, every check on, as in ``bench.bench_relay``) in front of
the same stand-in with the same Redis, PostgreSQL and tenants; each round measures both, in
alternating order, at the same load, so a shared machine's noise falls on both alike. Prints the
median and spread per version and the median of the per-round B/A ratios; with ``--floor``, the
aiohttp pass-through (``bench.relay_floors``, no checks) is measured in the same rounds too, and
each version's per-round ratio to it (issue 33's goal: at most 2.0x per non-streaming request)
is printed with its spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import uvloop

from bench.bench_relay import INTERVAL_S, TOKENS, Bench
from bench.relay_report import spread
from bench.relay_systems import Relay, Systems, pin_self


async def measure(args: argparse.Namespace, systems: Systems) -> dict[str, dict[str, list[float]]]:
    standin = systems.standin(engines=1, interval_s=INTERVAL_S)
    pair = systems.gateways({"A": args.a, "B": args.b}, canary_rate=args.canary_rate)
    floors: list[Relay] = [systems.floor("aiohttp", standin)] if args.floor else []
    pair = [*pair, *floors]
    bench = Bench(args, systems, pair, Relay("direct", systems.standin_ports[0], "", None))
    for relay in pair:
        await bench.run(relay, bench.workload(relay, stream=False), 50, 1)
        await bench.run(relay, bench.workload(relay, stream=True), 10, 1)
    found: dict[str, dict[str, list[float]]] = {r.name: {"request": [], "event": []} for r in pair}
    for r in range(args.rounds):
        for relay in pair if r % 2 == 0 else pair[::-1]:
            plain = await bench.run(
                relay, bench.workload(relay, stream=False), args.cost_rate, args.seconds
            )
            found[relay.name]["request"].append((plain.cpu_s or 0.0) / plain.ok * 1e6)
            streams = await bench.run(
                relay, bench.workload(relay, stream=True), args.stream_rate, args.seconds
            )
            per_event = (streams.cpu_s or 0.0) / (streams.ok * (TOKENS + 3)) * 1e6
            found[relay.name]["event"].append(per_event)
    return found


def tables(found: dict[str, dict[str, list[float]]]) -> str:
    """A vs B (medians, spreads, the median of per-round B/A ratios); with a third system (the
    floor), each version's per-round ratio to it, median and spread."""
    lines = ["| CPU | A | B | B / A (median of rounds) |", "|---|---|---|---|"]
    for unit, digits in (("request", 0), ("event", 1)):
        a, b = found["A"][unit], found["B"][unit]
        ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
        lines.append(f"| µs per {unit} | {spread(a, digits)} | {spread(b, digits)} | {ratio:.3f} |")
    floor = next((name for name in found if name not in ("A", "B")), None)
    if floor is not None:
        lines += ["", f"| CPU, per round / {floor} | {floor} | A | B |", "|---|---|---|---|"]
        for unit, digits in (("request", 0), ("event", 1)):
            base = found[floor][unit]
            a, b = ([y / x for x, y in zip(base, found[v][unit], strict=True)] for v in "AB")
            lines.append(
                f"| per {unit} | {spread(base, digits)} µs | {spread(a, 2)}x | {spread(b, 2)}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--cost-rate", type=float, default=100.0)
    parser.add_argument("--stream-rate", type=float, default=10.0)
    parser.add_argument("--canary-rate", type=float, default=0.1)
    parser.add_argument(
        "--floor", action="store_true", help="also the aiohttp pass-through, and ratios to it"
    )
    args = parser.parse_args(argv)
    pin_self()
    with tempfile.TemporaryDirectory(prefix="kvguard-relay-ab-") as tmp:
        systems = Systems(Path(tmp))
        try:
            found = uvloop.run(measure(args, systems))
        finally:
            systems.close()
    print(f"A = {args.a}, B = {args.b}; {args.rounds} rounds of {args.seconds:g} s")
    print(tables(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
