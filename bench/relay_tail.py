"""The gateway's tail at a fixed rate, several checkouts side by side, fresh and after a burst.

Run: ``python -m bench.relay_tail CHECKOUT [CHECKOUT ...] [--rate 500] [--rounds 4]
[--seconds 6] [--tokens 64]``, e.g. ``python -m bench.relay_tail /tmp/base .`` for what a change
does to issue 33's "added p99 < 5 ms at 500 requests/s". Each checkout's ``kvguard gateway``
runs (pinned, production mode, every check on, as in ``bench.bench_relay``) in front of the same
stand-in, Redis, PostgreSQL and 10 tenants (the canary marks 10%). Non-streaming chat
completions of ``--tokens`` tokens (the relay benchmark's whole answers) go at ``--rate`` for
``--rounds`` rounds per gateway, alternating the order; each round is followed by the same rate
straight to the stand-in, and the gateway's *added* p99 is its p99 minus that one. Then every
gateway takes a burst (``--burst`` requests/s for 5 s, then 150 streams/s of 64 tokens for 5 s:
caches fill, objects are promoted) and the rounds are measured again. Prints, per phase and
checkout, the median [min..max] over rounds of the p99, the added p99 and the CPU per request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import uvloop

from bench.bench_relay import INTERVAL_S, workload
from bench.relay_load import Driver
from bench.relay_systems import Relay, Systems, pin_self, started

PHASES = ("fresh", "after a burst")


@dataclass(frozen=True, slots=True)
class Round:
    p99_ms: float
    added_p99_ms: float
    cpu_us: float  # per request
    errors: int


async def measure(args: argparse.Namespace, systems: Systems) -> dict[tuple[str, str], list[Round]]:
    systems.standin(engines=1, interval_s=INTERVAL_S)
    gateways = systems.gateways({str(checkout): checkout for checkout in args.checkouts})
    direct = Relay("direct", systems.standin_ports[0], gateways[0].model, None)
    drivers = {r.name: Driver("127.0.0.1", r.port) for r in [direct, *gateways]}
    plain = {r.name: workload(r, stream=False, tokens=args.tokens) for r in [direct, *gateways]}
    found: dict[tuple[str, str], list[Round]] = {}

    async def rounds(phase: str) -> None:
        for r in range(args.rounds):
            for gateway in gateways if r % 2 == 0 else gateways[::-1]:
                got = await drivers[gateway.name].run(
                    plain[gateway.name],
                    rate=args.rate,
                    seconds=args.seconds,
                    cpu_pids=[gateway.pid] if gateway.pid else [],
                    load_pids=[],
                )
                base = await drivers[direct.name].run(
                    plain[direct.name], rate=args.rate, seconds=2, cpu_pids=[], load_pids=[]
                )
                found.setdefault((phase, gateway.name), []).append(
                    Round(
                        got.p(0.99),
                        got.p(0.99) - base.p(0.99),
                        got.cpu_s / max(1, got.ok) * 1e6,
                        got.errors,
                    )
                )

    for gateway in gateways:  # warm: keys verified, connections open
        await drivers[gateway.name].run(
            plain[gateway.name], rate=200, seconds=3, cpu_pids=[], load_pids=[]
        )
    await rounds(PHASES[0])
    for gateway in gateways:
        driver = drivers[gateway.name]
        await driver.run(plain[gateway.name], rate=args.burst, seconds=5, cpu_pids=[], load_pids=[])
        streamed = workload(gateway, stream=True, tokens=64)
        await driver.run(streamed, rate=150, seconds=5, cpu_pids=[], load_pids=[])
    await rounds(PHASES[1])
    return found


def table(found: dict[tuple[str, str], list[Round]]) -> str:
    """Per phase and checkout: median [min..max] over rounds."""

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):,.2f} [{min(values):,.2f}..{max(values):,.2f}]"

    lines = [
        "| phase | gateway | p99 ms | added p99 ms | CPU µs / request | errors |",
        "|---|---|---|---|---|---|",
    ]
    for (phase, name), got in found.items():
        lines.append(
            f"| {phase} | {name} | {cell([g.p99_ms for g in got])} "
            f"| {cell([g.added_p99_ms for g in got])} | {cell([g.cpu_us for g in got])} "
            f"| {sum(g.errors for g in got)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", type=Path)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--burst", type=float, default=900.0)
    args = parser.parse_args(argv)
    pin_self()
    with (
        tempfile.TemporaryDirectory(prefix="kvguard-relay-tail-") as tmp,
        started(Path(tmp)) as systems,
    ):
        found = uvloop.run(measure(args, systems))
    print(
        f"python -m bench.relay_tail {' '.join(map(str, args.checkouts))} --rate {args.rate:g} "
        f"--rounds {args.rounds} --seconds {args.seconds:g} --tokens {args.tokens} "
        f"--burst {args.burst:g}"
    )
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
