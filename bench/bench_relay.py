"""What guarding a request costs the gateway, against the cost of moving its bytes (issues 23, 33).

Run: ``python -m bench.bench_relay [--quick] [--skip-litellm] [--profile]`` (``--help``).

Side by side in one run, in front of one engine stand-in (``bench.relay_standin``: fixed
answers, ``max_tokens`` SSE events at a set rate, usage included, vLLM's chunk shapes; it costs a
few µs per event):

- ``aiohttp pass-through`` and ``lean asyncio relay`` (``bench.relay_floors``): no checks, the
  cost of moving bytes, naive and lean;
- ``kvguard gateway``: ``kvguard gateway`` in production mode with every check on: tenant keys,
  Redis limits (requests and tokens per minute), PostgreSQL audit, the exact prompt count, the
  canary's injection (``--canary-rate`` of each tenant's requests get a marker) and its leak
  firewall on every byte of every answer;
- ``kvguard pump, checks off``: the same data plane (server protocol, engine client, pump, relay)
  with every check off (``bench.relay_candidates`` ``pump-no-checks``): what the checks cost is
  the gateway's row minus this one;
- ``LiteLLM proxy`` (``litellm --config``, master key, offline; its own venv, as ``bench_proxy``).

Placement: each relay runs pinned to one core (``taskset -c 0``); the load generator
(``bench.relay_load``, open loop), the stand-in, Redis and PostgreSQL share the other. CPU is the
relay process's user + system time from ``/proc`` over a measurement, divided by the answers (or
by the stand-in's events: ``max_tokens + 3`` per streamed answer, 67 for the default 64 tokens).

Measured, per system:

1. CPU per non-streaming request (``--cost-rate`` requests/s) and per streamed event
   (``--stream-rate`` streams/s), in ``--rounds`` rounds with the systems' order rotated each
   round; the table gives the median and the spread over rounds; at the stream rate also how
   much later than straight from the stand-in (the direct path, measured in the same round) a
   streamed answer's last event came, p50 and p99 (the last event carries whatever the firewall
   held back, so this bounds the delay the relay adds to any event);
2. the largest rate at which p99 stays under 50 ms (non-streaming: the answer; streaming: the
   first bytes and how late the last event came against the stand-in's schedule) with no error:
   a ramp by ``--ramp`` from half the rate the CPU cost predicts (down by halves if that misses),
   then bisection; a rate that misses is tried once more; marked ``>=`` when the load side's core,
   not the relay, ran out (the generator busy, sending late, while the relay had core to spare:
   a relay that used 90% of its core or more is at its own limit and judged by the bound), ``<``
   when even 1/s missed;
3. added latency (path p50/p99 minus the direct path's, same rate, same rounds) at 100, 500 and
   1,000 requests/s non-streaming, where the system reached that rate in 2;
4. growth of CPU per request (non-streaming): 10 -> ``--tenants`` active tenants (keys used in
   turn), 1 -> ``--engines`` engines (stand-in ports), prompts of 1k -> 100k tokens (the byte
   tokenizer's: one per byte; counted and scanned by the gateway).

Goals (issue 33), every check on: kvguard's CPU per streamed event at most 1.0x and per
non-streaming request at most 2.0x the aiohttp pass-through's, as ratios taken round by round (the
systems of one round share its load); max streamed events/s at least 15x LiteLLM proxy's;
gateway-added p99 < 5 ms at 500 req/s; and the stated bound on an event's added delay: the last
event's p99 at most one event interval (10 ms) later than direct. Exit status 1 if one is missed.
Which server layer and upstream reader the data plane uses was chosen by
``bench.relay_candidates`` (the same load, pass-throughs without checks). The tables also go to
``bench/results/relay.md`` (``--out``); a run that writes there also rewrites the benchmark page's
generated section (``bench.relay_report``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

from bench import relay_report
from bench.relay_load import Driver, Samples, Workload, chat_request, percentile
from bench.relay_report import Max, Outcome, report
from bench.relay_standin import ANSWER, MODEL
from bench.relay_systems import Relay, Systems, create_tenants, pin_self

TOKENS = 64
INTERVAL_S = 0.010
RATES = (100, 500, 1000)
P99_BOUND_MS = 50.0
MIN_RATE = 1.0  # the ceiling search's lowest rate (requests or streams per second)
LAG_BOUND_MS = 50.0  # a generator sending later than this at p99 is itself the limit
LOAD_BOUND = 0.9  # ... as is a load side (generator + stand-in) using this share of its core
RELAY_FULL = 0.9  # ... unless the relay uses this share of its own core: then it is the limit
BASE_PROMPT = "Summarise the following in one paragraph: the gateway relays every token."
RESULTS = Path(__file__).resolve().parent / "results" / "relay.md"


def workload(
    relay: Relay,
    *,
    stream: bool,
    tokens: int = TOKENS,
    prompt: str = BASE_PROMPT,
    tenants: int = 10,
) -> Workload:
    """Chat completions of ``tokens`` tokens through ``relay``, one per key of its first
    ``tenants`` tenants in turn (no key for a relay without keys)."""
    keys = relay.keys[:tenants] or (None,)
    requests = tuple(
        chat_request(
            f"127.0.0.1:{relay.port}",
            model=relay.model,
            key=key,
            content=prompt,
            tokens=tokens,
            stream=stream,
        )
        for key in keys
    )
    return Workload(requests, stream, tokens, INTERVAL_S)


def prompt_of(tokens: int) -> str:
    """About ``tokens`` tokens of the bundled byte tokenizer (one per UTF-8 byte) of prose."""
    return (ANSWER * (tokens // len(ANSWER) + 1))[:tokens]


@dataclass
class Bench:
    args: argparse.Namespace
    systems: Systems
    relays: list[Relay]
    direct: Relay
    missing_litellm: str | None = None  # why the LiteLLM proxy is not measured, if it is not
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    _drivers: dict[int, Driver] = field(default_factory=dict)

    def driver(self, relay: Relay) -> Driver:
        return self._drivers.setdefault(relay.port, Driver("127.0.0.1", relay.port))

    def workload(
        self, relay: Relay, *, stream: bool, prompt: str = BASE_PROMPT, tenants: int = 10
    ) -> Workload:
        return workload(relay, stream=stream, prompt=prompt, tenants=tenants)

    async def run(self, relay: Relay, workload: Workload, rate: float, seconds: float) -> Samples:
        pids = [relay.pid] if relay.pid is not None else []
        samples = await self.driver(relay).run(
            workload,
            rate=rate,
            seconds=seconds,
            cpu_pids=pids,
            load_pids=[self.systems.standin_pid],
        )
        print(
            f"  {relay.name:22} {'stream' if workload.stream else 'plain':6} {rate:8.0f}/s "
            f"ok {samples.ok:6} err {samples.errors:4} p50 {samples.p(0.5):7.2f} "
            f"p99 {samples.p(0.99):8.2f} ms lag p99 {percentile(samples.lag_ms, 0.99):6.2f}",
            file=sys.stderr,
            flush=True,
        )
        return samples

    def outcome(self, relay: Relay) -> Outcome:
        return self.outcomes.setdefault(relay.name, Outcome(relay.name))

    # -- 1. CPU per request and per event ---------------------------------------------------

    async def cost(self) -> None:
        args = self.args
        for r in range(args.rounds):
            shift = r % len(self.relays)
            base = await self.run(
                self.direct,
                self.workload(self.direct, stream=True),
                args.stream_rate,
                args.cost_seconds,
            )
            for relay in self.relays[shift:] + self.relays[:shift]:
                out = self.outcome(relay)
                plain = await self.run(
                    relay, self.workload(relay, stream=False), args.cost_rate, args.cost_seconds
                )
                out.request_us.append(_per(plain.cpu_s, plain.ok) * 1e6)
                out.errors += plain.errors
                streams = await self.run(
                    relay, self.workload(relay, stream=True), args.stream_rate, args.cost_seconds
                )
                out.event_us.append(_per(streams.cpu_s, streams.ok * (TOKENS + 3)) * 1e6)
                late = (streams.p(0.5) - base.p(0.5), streams.p(0.99) - base.p(0.99))
                out.event_delay_ms.append(late)
                out.errors += streams.errors

    # -- 2. the largest rate under the latency bound -----------------------------------------

    async def ceilings(self) -> None:
        for relay in self.relays:
            out = self.outcome(relay)
            plain = self.workload(relay, stream=False)
            out.max_requests = await self.ceiling(relay, plain, 1e6 / _median(out.request_us))
            stream = self.workload(relay, stream=True)
            per_stream = _median(out.event_us) * (TOKENS + 3)
            found = await self.ceiling(relay, stream, 1e6 / per_stream)
            out.max_events = found.scaled(TOKENS + 3)

    async def ceiling(self, relay: Relay, workload: Workload, predicted: float) -> Max:
        """Up by ``--ramp`` from half the predicted rate until the bound is missed (down by
        halves first if even that misses it), then ``--bisect`` steps between pass and miss."""
        args = self.args
        rate = max(MIN_RATE, round(predicted * 0.5, -1))
        passed, failed = 0.0, None
        for _ in range(40):
            verdict = await self.step(relay, workload, rate)
            if verdict == "load":
                return Max(passed or rate, bounded_by_load=True)
            if verdict == "ok":
                passed = rate
                if failed is not None:
                    break
                rate *= args.ramp
            else:
                failed = rate
                if passed:
                    break
                if rate <= MIN_RATE:
                    return Max(0.0, below=rate)
                rate = max(MIN_RATE, rate / 2)
        for _ in range(args.bisect if failed is not None else 0):
            middle = (passed + failed) / 2
            verdict = await self.step(relay, workload, middle)
            if verdict == "load":
                return Max(passed, bounded_by_load=True)
            passed, failed = (middle, failed) if verdict == "ok" else (passed, middle)
        return Max(passed)

    async def step(self, relay: Relay, workload: Workload, rate: float) -> str:
        """One rate's verdict; a miss is tried once more (other work on a shared machine stalls
        a relay for tens of ms now and then: a rate passes if one of two tries meets the bound)."""
        verdict = self.judge(await self.run(relay, workload, rate, self.args.step_seconds))
        if verdict == "over":
            verdict = self.judge(await self.run(relay, workload, rate, self.args.step_seconds))
        return verdict

    @staticmethod
    def judge(samples: Samples) -> str:
        """ok, over (the relay missed the bound) or load (the load side could not keep up while
        the relay had core to spare: a relay that used its whole core is judged by the bound,
        however busy the load side was)."""
        wall = samples.wall_s or 1.0
        busy = samples.load_cpu_s / wall
        relay_full = samples.cpu_s is not None and samples.cpu_s / wall >= RELAY_FULL
        late = percentile(samples.lag_ms, 0.99) > LAG_BOUND_MS
        if not relay_full and (busy > LOAD_BOUND or (late and busy > LOAD_BOUND / 2)):
            return "load"  # late alone: the machine
        slow = samples.p(0.99) >= P99_BOUND_MS
        if samples.ttfts_ms:
            slow = slow or percentile(samples.ttfts_ms, 0.99) >= P99_BOUND_MS
        return "over" if slow or samples.errors or not samples.ok else "ok"

    # -- 3. added latency at fixed rates ------------------------------------------------------

    async def latency(self) -> None:
        args = self.args
        paths = [self.direct, *self.relays]
        for rate in RATES:
            reachable = [p for p in paths if p is self.direct or self._reaches(p, rate)]
            pooled: dict[str, Samples] = {p.name: Samples() for p in reachable}
            for r in range(args.rounds):
                shift = r % len(reachable)
                for path in reachable[shift:] + reachable[:shift]:
                    got = await self.run(
                        path, self.workload(path, stream=False), rate, args.latency_seconds
                    )
                    _merge(pooled[path.name], got)
            base = pooled[self.direct.name]
            for relay in self.relays:
                out = self.outcome(relay)
                got = pooled.get(relay.name)
                if got is None:
                    continue
                out.added[rate] = (
                    got.p(0.5) - base.p(0.5),
                    got.p(0.99) - base.p(0.99),
                    got.errors,
                )

    def _reaches(self, relay: Relay, rate: int) -> bool:
        """Whether the ceiling search reached ``rate`` (or the load side ran out first and the
        CPU cost says the relay's core could take it)."""
        out = self.outcome(relay)
        found = out.max_requests
        if found is None:
            return False
        capacity = 1e6 / _median(out.request_us)
        return found.rate >= rate or (found.bounded_by_load and capacity >= rate)

    # -- 4. growth ------------------------------------------------------------------------------

    async def growth_prompts(self) -> None:
        args = self.args
        for tokens in args.prompts:
            for relay in self.relays:
                workload = self.workload(relay, stream=False, prompt=prompt_of(tokens))
                got = await self.run(relay, workload, args.prompt_rate, args.cost_seconds)
                self.outcome(relay).growth[f"prompt {tokens:,} tokens"] = [
                    _per(got.cpu_s, got.ok) * 1e6
                ]

    async def growth_tenants(self, gateway: Relay) -> None:
        args = self.args
        out = self.outcome(gateway)
        for r in range(args.rounds):
            order = [10, args.tenants] if r % 2 == 0 else [args.tenants, 10]
            for tenants in order:
                workload = self.workload(gateway, stream=False, tenants=tenants)
                got = await self.run(gateway, workload, args.cost_rate, args.cost_seconds)
                label = f"{tenants:,} tenants"
                out.growth.setdefault(label, []).append(_per(got.cpu_s, got.ok) * 1e6)

    async def growth_engines(self, one: Relay, many: Relay) -> None:
        args = self.args
        out = self.outcome(one)
        for r in range(args.rounds):
            pair = [(one, 1), (many, args.engines)]
            for relay, engines in pair if r % 2 == 0 else pair[::-1]:
                got = await self.run(
                    relay, self.workload(relay, stream=False), args.cost_rate, args.cost_seconds
                )
                label = f"{engines} engine{'s' if engines > 1 else ''}"
                out.growth.setdefault(label, []).append(_per(got.cpu_s, got.ok) * 1e6)


def _per(cpu: float | None, count: int) -> float:
    return (cpu or 0.0) / count if count else float("nan")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def _merge(into: Samples, more: Samples) -> None:
    into.sent += more.sent
    into.ok += more.ok
    into.errors += more.errors
    into.latencies_ms += more.latencies_ms
    into.lag_ms += more.lag_ms


async def measure(args: argparse.Namespace, systems: Systems, tmp: Path) -> Bench:
    standin = systems.standin(engines=args.engines, interval_s=INTERVAL_S)
    redis_url, database_url = systems.services()
    print(f"creating {args.tenants:,} tenants ...", file=sys.stderr, flush=True)
    keys = tuple(create_tenants(database_url, args.tenants, canary_rate=args.canary_rate))
    gateway = systems.gateway(redis_url=redis_url, database_url=database_url, engines=1, keys=keys)
    relays = [systems.floor("aiohttp", standin), systems.floor("lean", standin), gateway]
    relays.append(systems.pump_without_checks(standin))  # the floor of the gateway's own pump
    missing = None
    if not args.skip_litellm:
        proxy = systems.litellm(standin)
        if isinstance(proxy, Relay):
            relays.append(proxy)
        else:
            missing = proxy
    direct = Relay("direct (no relay)", systems.standin_ports[0], MODEL, None)
    bench = Bench(args, systems, relays, direct, missing)
    for relay in [direct, *relays]:  # warm code paths and connection pools
        await bench.run(relay, bench.workload(relay, stream=False), 50, 1)
        await bench.run(relay, bench.workload(relay, stream=True), 20, 1)
    await bench.cost()
    await bench.ceilings()
    await bench.latency()
    await bench.growth_tenants(gateway)
    await bench.growth_prompts()
    many = systems.gateway(
        redis_url=redis_url, database_url=database_url, engines=args.engines, keys=keys
    )
    await bench.run(many, bench.workload(many, stream=False), 50, 1)
    await bench.growth_engines(gateway, many)
    return bench


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter measurements, 2 rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cost-seconds", type=float, default=5.0)
    parser.add_argument("--cost-rate", type=float, default=100.0, help="requests/s")
    parser.add_argument("--stream-rate", type=float, default=10.0, help="streams/s")
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    parser.add_argument("--step-seconds", type=float, default=3.0, help="per ramp step")
    parser.add_argument("--ramp", type=float, default=1.25)
    parser.add_argument("--bisect", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--prompt-rate", type=float, default=50.0, help="requests/s")
    parser.add_argument("--canary-rate", type=float, default=0.1, help="share of requests marked")
    parser.add_argument("--skip-litellm", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.cost_seconds, args.latency_seconds = 2, 3.0, 2.0
        args.step_seconds, args.ramp, args.bisect = 2.0, 1.4, 1
    if args.rounds < 1 or args.tenants < 10 or args.engines < 1:
        parser.error("--rounds >= 1, --tenants >= 10 and --engines >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pin_self()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-relay-") as tmp:
        systems = Systems(Path(tmp))
        try:
            bench = uvloop.run(measure(args, systems, Path(tmp)))
        finally:
            systems.close()
    text, met = report(
        args,
        list(bench.outcomes.values()),
        load=(load_before, os.getloadavg()),
        missing_litellm=bench.missing_litellm,
    )
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    if args.out.resolve() == RESULTS:  # the report of record: the benchmark page shows it
        relay_report.refresh_page()
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
