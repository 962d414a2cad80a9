"""Where a relay's CPU goes by the shape of the work: CPU per request at several answer lengths and
rates, side by side, and from it the cost of each added streamed event and the fixed cost left.

Run: ``python -m bench.relay_slope [CHECKOUT ...] [--rounds 3] [--seconds 5] [--cases ...]``;
with no checkout, this one's gateway. Each case is ``KIND:TOKENS:RATE``: ``s`` (streamed) or ``p``
(a whole answer), ``max_tokens``, requests per second (default: ``s:1:10 s:64:10 s:1:100
p:1:10 p:1:100``).

Systems, placed as ``bench.bench_relay`` places them (relays pinned to one core, the rest on the
other), in front of the same stand-in, Redis, PostgreSQL and 10 tenants: the kvguard gateway of
each checkout (production mode, every check on), the gateway's data plane with every check off
(``bench.relay_candidates``' pump) and the aiohttp pass-through. Each round measures every system
in turn: its CPU while idle (ms per second), then every case. Printed: the median (min-max) CPU
µs per request of each case, and for each pair of streamed cases at one rate, what an added event
costs ((b - a) / (tokens_b - tokens_a)) and what a stream costs besides its events.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import uvloop

from bench.bench_relay import INTERVAL_S
from bench.relay_load import Driver, Workload, chat_request, cpu_between, cpu_snapshot
from bench.relay_systems import Relay, Systems, pin_self, started

DEFAULT_CASES = ("s:1:10", "s:64:10", "s:1:100", "p:1:10", "p:1:100")
IDLE = "idle ms/s"


@dataclass(frozen=True, slots=True)
class Case:
    stream: bool
    tokens: int
    rate: float

    @classmethod
    def of(cls, text: str) -> Case:
        kind, tokens, rate = text.split(":")
        if kind not in ("s", "p"):
            raise argparse.ArgumentTypeError(f"{text}: the kind is s or p")
        return cls(kind == "s", int(tokens), float(rate))

    def __str__(self) -> str:
        return f"{'s' if self.stream else 'p'}:{self.tokens}:{self.rate:g}"


def workload(relay: Relay, case: Case) -> Workload:
    keys = relay.keys[:10] or (None,)
    requests = tuple(
        chat_request(
            f"127.0.0.1:{relay.port}",
            model=relay.model,
            key=key,
            content="Say something.",
            tokens=case.tokens,
            stream=case.stream,
        )
        for key in keys
    )
    return Workload(requests, case.stream, case.tokens, INTERVAL_S)


async def measure(args: argparse.Namespace, systems: Systems) -> dict[str, dict[str, list[float]]]:
    standin = systems.standin(engines=1, interval_s=INTERVAL_S)
    relays = systems.gateways(
        {
            f"kvguard gateway ({checkout})" if checkout else "kvguard gateway": checkout
            for checkout in args.checkouts or [None]
        }
    )
    relays += [systems.pump_without_checks(standin), systems.floor("aiohttp", standin)]
    found: dict[str, dict[str, list[float]]] = {r.name: {} for r in relays}
    drivers = {r.name: Driver("127.0.0.1", r.port) for r in relays}
    for relay in relays:  # warm: keys verified, connections open
        await drivers[relay.name].run(
            workload(relay, Case(True, 8, 10)), rate=10, seconds=1, cpu_pids=[], load_pids=[]
        )
    for _ in range(args.rounds):
        for relay in relays:
            assert relay.pid is not None
            before = cpu_snapshot([relay.pid])
            loop = asyncio.get_running_loop()
            start = loop.time()
            await asyncio.sleep(args.seconds)  # idle: what the process spends on its own
            idle = cpu_between(before, cpu_snapshot([relay.pid])) / (loop.time() - start)
            found[relay.name].setdefault(IDLE, []).append(idle * 1e3)
            for case in args.cases:
                samples = await drivers[relay.name].run(
                    workload(relay, case),
                    rate=case.rate,
                    seconds=args.seconds,
                    cpu_pids=[relay.pid],
                    load_pids=[systems.standin_pid],
                )
                per = (samples.cpu_s or 0.0) / max(1, samples.ok) * 1e6
                found[relay.name].setdefault(str(case), []).append(per)
                print(f"  {relay.name:40} {case!s:10} {per:9.0f} µs", file=sys.stderr, flush=True)
    return found


def tables(found: dict[str, dict[str, list[float]]], cases: list[Case]) -> str:
    """CPU per request of each case (median, min-max over rounds); per added event and fixed per
    stream for each pair of streamed cases at one rate (from the medians)."""
    columns = [IDLE, *map(str, cases)]
    lines = [
        "| system | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name, measured in found.items():
        cells = [_spread(measured[column]) for column in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    pairs = [
        (a, b)
        for a in cases
        for b in cases
        if a.stream and b.stream and a.rate == b.rate and a.tokens < b.tokens
    ]
    if pairs:
        lines += [
            "",
            "| system | streams | µs per added event | µs per stream besides its events |",
        ]
        lines.append("|---|---|---|---|")
        for name, measured in found.items():
            for a, b in pairs:
                low, high = (statistics.median(measured[str(c)]) for c in (a, b))
                per_event = (high - low) / (b.tokens - a.tokens)
                fixed = low - per_event * (a.tokens + 3)  # a stream of n tokens has n + 3 events
                lines.append(f"| {name} | {a} vs {b} | {per_event:.1f} | {fixed:,.0f} |")
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="*", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--cases", nargs="+", type=Case.of, default=list(map(Case.of, DEFAULT_CASES))
    )
    args = parser.parse_args(argv)
    pin_self()
    with (
        tempfile.TemporaryDirectory(prefix="kvguard-relay-slope-") as tmp,
        started(Path(tmp)) as systems,
    ):
        found = uvloop.run(measure(args, systems))
    print(f"python -m bench.relay_slope; {args.rounds} rounds of {args.seconds:g} s per case")
    print(tables(found, args.cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
