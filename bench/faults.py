"""Faults under load: break one part of a real stack while clients run, prove nothing leaks.

``python -m bench.faults [--clients N] [--only NAME ...]`` starts one stack (``bench.fault_stack``:
gateway + decode + prefill with the bundled model, private Redis and PostgreSQL), runs every
scenario on it in turn and prints the report table. ``tests/faults/`` runs the same scenarios with
small sizes and asserts on the rows.

Every scenario has the same shape (``_run``):

1. the stack serves correctly (one echo request comes back with its own marker);
2. ``n_clients`` content-checked clients (``bench.fault_load``) run in a closed loop;
3. the fault is applied, held for ``hold_s``, then cleared (the clearing is part of recovery:
   a restarted role loads its model again);
4. recovery: echo requests until one succeeds (``recovery_s`` is from "clear" to that answer);
5. the load stops; afterwards: every pool holds ``free + owned + shared + quarantined == total``
   and drains to no owned or quarantined page and no prefix-cache page with a reader; the tenant
   can open its whole concurrency cap at once; every request the gateway numbered has exactly one
   audit row whose outcome matches what the client saw.

Faults: ``decode_crash`` (SIGKILL decode mid-stream, restart it), ``prefill_crash`` (SIGKILL prefill
while transfers are in flight over a slowed link, restart it), ``redis_down`` / ``postgres_down``
(the gateway's link to the service is cut: refused and reset, data kept; then restored),
``slow_transfer`` (prefill's link slowed past decode's handoff lease, then back to normal),
``cancel_storm`` (every client drops its stream after the first events).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from bench.fault_load import (
    Live,
    Outcome,
    ask,
    clients,
    codec_for,
    codes,
    engine_copies,
    hold_cap,
)
from bench.fault_stack import FaultStack, fault_stack, wait_for
from bench.summary import emit

# Transfers of one echo prompt (~6 pages of 4 KiB per token with the bundled model) take about
# 1 s at MID_LINK and 4 s at SLOW_LINK; the stack's decode lease (handoff timeout) is LEASE_S.
MID_LINK = "4e5"
SLOW_LINK = "1e5"
LEASE_S = "2.0"
DRAIN_TIMEOUT_S = 30.0
MODEL_MISS = "model_miss"  # a 200 without its marker that the engine, from scratch, misses too
MODEL_MISS_KEY = f"{MODEL_MISS}:no_own_marker"  # how one shows in FaultRow.during and .after
KILL_ATTEMPTS = 3  # decode_crash: kills until one cuts a stream


@dataclass
class FaultRow:
    fault: str
    requests: int  # that ended while the fault was on
    during: dict[str, int]  # outcomes while the fault was on, by kind:code
    leaked_markers: int  # foreign markers delivered, over the whole scenario
    wrong_content: int  # 200s without their own marker or silently cut, whole scenario
    model_misses: int  # 200s without their own marker that the engine itself, asked directly,
    # also answers without it (the tiny model's copy error, not the gateway's): not wrong
    unclear_errors: int  # errors without an OpenAI-style code or dropped connections, whole
    recovery_s: float | None  # from clearing the fault to the first correct answer
    after: dict[str, int]  # outcomes of the concurrency-cap check after recovery
    drained_pages: float = 0.0  # pages decode quarantined and freed during the scenario
    pool_violations: list[str] = field(default_factory=list)
    audit_problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.leaked_markers == 0
            and self.wrong_content == 0
            and self.unclear_errors == 0
            and self.recovery_s is not None
            and set(self.after) <= {"ok", MODEL_MISS_KEY}
            and not self.pool_violations
            and not self.audit_problems
        )


Step = Callable[[FaultStack, Live], Awaitable[None]]


async def _blocking(fn: Callable[[], Any]) -> Any:
    return await asyncio.to_thread(fn)


async def _recover(fs: FaultStack, timeout_s: float = 90.0) -> tuple[float | None, list[Outcome]]:
    """Echo requests until one is answered correctly; (seconds it took, every outcome)."""
    assert fs.tenant is not None
    codec, started, seen = codec_for(fs.canary_key), time.monotonic(), []
    async with httpx.AsyncClient(base_url=fs.url, timeout=30) as client:
        while time.monotonic() - started < timeout_s:
            outcome = await ask(client, fs.tenant, codec)
            seen.append(outcome)
            if outcome.kind == "ok":
                return time.monotonic() - started, seen
            await asyncio.sleep(0.1)
    return None, seen


def _pool_violations(fs: FaultStack) -> list[str]:
    """Wait for both pools to drain; report any invariant that does not hold."""
    problems: list[str] = []
    for role in (fs.decode, fs.prefill):
        try:
            pool = wait_for(partial(_drained, fs, role), DRAIN_TIMEOUT_S, f"{role.name} drain")
        except TimeoutError:
            pool = fs.pool(role)
            problems.append(f"{role.name} did not drain: {pool}")
        held = pool["owned"] + pool["shared"] + pool["quarantined"]
        if pool["free"] + held != pool["total"]:
            problems.append(f"{role.name} pool does not add up: {pool}")
    staging = fs.staging()
    if staging["free"] != staging["total"]:
        problems.append(f"prefill staging not released: {staging}")
    return problems


def _drained(fs: FaultStack, role: Any) -> dict[str, float] | None:
    pool = fs.pool(role)
    # Shared pages may stay in the prefix cache once drained, but none may still have a reader:
    # every one of them must be available to a new request.
    drained = pool["owned"] == 0 and pool["quarantined"] == 0
    return pool if drained and pool["available"] == pool["total"] else None


# error codes of answers given before the request's key was verified
REFUSED_BEFORE_AUTH = frozenset({"database_unavailable", "invalid_api_key"})


def _audit_problems(fs: FaultStack, outcomes: list[Outcome]) -> list[str]:
    """Every request the gateway authenticated has one audit row, and the row agrees with the
    client. Every answer carries a request id, but one refused before its tenant was known (the
    database did not answer the key lookup) has no row: the audit records what a tenant did."""
    numbered = {
        o.request_id: o for o in outcomes if o.request_id and o.code not in REFUSED_BEFORE_AUTH
    }
    ids = list(numbered)

    def complete() -> dict[str, list[dict[str, Any]]] | None:
        rows = fs.audit_rows(ids)
        return rows if all(len(r) == 1 for r in rows.values()) else None

    try:
        rows = wait_for(complete, 20.0, "audit rows", poll_s=0.3)
    except TimeoutError:
        rows = fs.audit_rows(ids)
    problems = []
    for rid, found in rows.items():
        if len(found) != 1:
            problems.append(f"{len(found)} audit rows for a {numbered[rid].kind} request")
        elif not _agrees(numbered[rid], found[0]):
            problems.append(f"client saw {numbered[rid].kind}, audit says {found[0]}")
    return problems


async def _attributed(fs: FaultStack, outcome: Outcome) -> Outcome:
    """A 200 that ended well without its own marker, asked again of the engine directly after
    the scenario: when the engine's own greedy answer lacks it too, the model miscopied it."""
    if outcome.kind != "wrong" or outcome.code != "no_own_marker":
        return outcome
    copied = await engine_copies(fs.decode.url, fs.engine_token, outcome.marker)
    return outcome if copied else dataclasses.replace(outcome, kind=MODEL_MISS)


def _unclear(outcome: Outcome) -> bool:
    """An error without an OpenAI-style code, or a connection the gateway dropped unexplained."""
    return (outcome.code or "").startswith(("unclear", "transport_"))


def _agrees(outcome: Outcome, row: dict[str, Any]) -> bool:
    if outcome.kind in ("ok", MODEL_MISS):
        return row["outcome"] == "completed" and row["status"] == 200
    if outcome.kind == "cancelled":  # the gateway may have finished just before the hang-up
        return row["outcome"] in ("cancelled", "completed")
    if outcome.status != 200:  # refused before the stream: the same status and code
        return row["status"] == outcome.status and row["code"] == outcome.code
    return row["outcome"] in ("failed", "cut") and row["code"] == outcome.code


async def _run(
    fs: FaultStack,
    name: str,
    *,
    apply: Step,
    clear: Step,
    n_clients: int,
    hold_s: float,
    drop_after_events: int | None = None,
) -> FaultRow:
    assert fs.tenant is not None
    codec = codec_for(fs.canary_key)
    before, seen = await _recover(fs, timeout_s=60)
    if before is None:
        raise RuntimeError(f"{name}: the stack does not serve before the fault: {codes(seen)}")
    stop, live = asyncio.Event(), Live()
    drained_at_start, restarts = await _blocking(fs.drained_pages), fs.decode.restarts
    load = asyncio.create_task(
        clients(
            fs.url,
            fs.tenant,
            codec,
            n_clients=n_clients,
            until=stop,
            drop_after_events=drop_after_events,
            live=live,
        )
    )
    await asyncio.sleep(0.5)
    fault_on = time.monotonic()
    await apply(fs, live)
    await asyncio.sleep(hold_s)
    clearing = time.monotonic()
    await clear(fs, live)
    fault_off = time.monotonic()
    recovered_s, probes = await _recover(fs)
    recovery_s = None if recovered_s is None else recovered_s + fault_off - clearing
    stop.set()
    outcomes = await load
    after = await hold_cap(fs.url, fs.tenant, codec)
    seen, outcomes, probes, after = [
        [await _attributed(fs, o) for o in group] for group in (seen, outcomes, probes, after)
    ]
    everything = [*seen, *outcomes, *probes, *after]
    during = [o for o in outcomes if fault_on <= o.ended <= fault_off]
    pool_violations = await _blocking(lambda: _pool_violations(fs))
    # A restarted decode counts from zero again.
    drained_before = 0.0 if fs.decode.restarts > restarts else drained_at_start
    drained = await _blocking(fs.drained_pages) - drained_before
    return FaultRow(
        fault=name,
        requests=len(during),
        during=codes(during),
        leaked_markers=sum(o.leaked for o in everything),
        wrong_content=sum(1 for o in everything if o.kind == "wrong"),
        model_misses=sum(1 for o in everything if o.kind == MODEL_MISS),
        unclear_errors=sum(1 for o in everything if _unclear(o)),
        recovery_s=recovery_s,
        after=codes(after),
        drained_pages=drained,
        pool_violations=pool_violations,
        audit_problems=await _blocking(lambda: _audit_problems(fs, everything)),
    )


# -- the faults -----------------------------------------------------------------------------------


async def decode_crash(fs: FaultStack, *, n_clients: int = 3, hold_s: float = 1.0) -> FaultRow:
    """SIGKILL decode while a stream has started and has its whole answer still to come, then
    start it again.

    On a busy machine the client may read a stream's first event only after the engine sent its
    end, so a kill can still miss every stream: then decode is started again and the kill
    retried (at most ``KILL_ATTEMPTS`` kills), until one cuts a stream.
    """

    def kill_at_a_start(fs: FaultStack, live: Live) -> None:
        # In one thread: no event-loop turn between seeing the stream and the kill.
        wait_for(lambda: bool(live.waiting), 30, "a stream that has started", 0.002)
        fs.decode.kill()

    async def kill_mid_stream(fs: FaultStack, live: Live) -> None:
        cut = live.cut
        for attempt in range(KILL_ATTEMPTS):
            await _blocking(partial(kill_at_a_start, fs, live))
            try:
                await _blocking(lambda: wait_for(lambda: live.cut > cut, 10, "a cut stream", 0.02))
                return
            except TimeoutError:
                if attempt + 1 < KILL_ATTEMPTS:
                    await restart(fs, live)

    async def restart(fs: FaultStack, live: Live) -> None:
        await _blocking(lambda: fs.restart(fs.decode))
        await _blocking(fs.wait_routable)

    return await _run(
        fs, "decode_crash", apply=kill_mid_stream, clear=restart, n_clients=n_clients, hold_s=hold_s
    )


async def _set_prefill(fs: FaultStack, link: str | None) -> None:
    """Restart prefill with the slow-link drill at ``link`` bytes/s, or without any drill; the
    engine is routable with a drill on only under an admin override (set here, then cleared)."""
    env = fs.prefill.env
    for name in ("KVGUARD_DRILL_LINK_BYTES_PER_S", "KVGUARD_ALLOW_FAULT_DRILLS"):
        env.pop(name, None)
    if link is not None:
        env |= {"KVGUARD_DRILL_LINK_BYTES_PER_S": link, "KVGUARD_ALLOW_FAULT_DRILLS": "true"}
    await _blocking(fs.prefill.stop)
    await _blocking(lambda: fs.restart(fs.prefill))
    await _blocking(lambda: fs.set_override(allow_unsafe=link is not None))
    await _blocking(fs.wait_routable)


async def _plain_prefill(fs: FaultStack, live: Live) -> None:
    await _set_prefill(fs, None)


async def prefill_crash(fs: FaultStack, *, n_clients: int = 3, hold_s: float = 1.0) -> FaultRow:
    """SIGKILL prefill while it writes KV into decode (transfers slowed to about a second so the
    kill lands mid-transfer), then start it again without the drill."""
    await _set_prefill(fs, MID_LINK)

    async def kill_mid_transfer(fs: FaultStack, live: Live) -> None:
        await _blocking(lambda: wait_for(fs.transfers_in_flight, 30, "a transfer", 0.02))
        await _blocking(fs.prefill.kill)

    return await _run(
        fs,
        "prefill_crash",
        apply=kill_mid_transfer,
        clear=_plain_prefill,
        n_clients=n_clients,
        hold_s=hold_s,
    )


async def slow_transfer(fs: FaultStack, *, n_clients: int = 3, hold_s: float = 6.0) -> FaultRow:
    """Prefill's link slowed past decode's handoff lease: every handoff in that time must end
    with a clear error and its pages quarantined, then freed; then the link is normal again."""

    async def slow(fs: FaultStack, live: Live) -> None:
        await _set_prefill(fs, SLOW_LINK)

    return await _run(
        fs, "slow_transfer", apply=slow, clear=_plain_prefill, n_clients=n_clients, hold_s=hold_s
    )


async def redis_down(fs: FaultStack, *, n_clients: int = 3, hold_s: float = 2.0) -> FaultRow:
    async def cut(fs: FaultStack, live: Live) -> None:
        fs.redis_link.cut()

    async def restore(fs: FaultStack, live: Live) -> None:
        fs.redis_link.restore()

    return await _run(
        fs, "redis_down", apply=cut, clear=restore, n_clients=n_clients, hold_s=hold_s
    )


async def postgres_down(fs: FaultStack, *, n_clients: int = 3, hold_s: float = 2.0) -> FaultRow:
    async def cut(fs: FaultStack, live: Live) -> None:
        fs.postgres_link.cut()

    async def restore(fs: FaultStack, live: Live) -> None:
        fs.postgres_link.restore()

    return await _run(
        fs, "postgres_down", apply=cut, clear=restore, n_clients=n_clients, hold_s=hold_s
    )


async def cancel_storm(fs: FaultStack, *, n_clients: int = 4, hold_s: float = 2.0) -> FaultRow:
    """Every client drops its stream after the first two events, over and over."""

    async def nothing(fs: FaultStack, live: Live) -> None:
        return None

    return await _run(
        fs,
        "cancel_storm",
        apply=nothing,
        clear=nothing,
        n_clients=n_clients,
        hold_s=hold_s,
        drop_after_events=2,
    )


SCENARIOS: dict[str, Callable[..., Awaitable[FaultRow]]] = {
    "decode_crash": decode_crash,
    "prefill_crash": prefill_crash,
    "redis_down": redis_down,
    "postgres_down": postgres_down,
    "slow_transfer": slow_transfer,
    "cancel_storm": cancel_storm,
}


def stack_options() -> dict[str, Any]:
    """The stack every scenario expects: decode's handoff lease short enough to be crossed."""
    return {"decode_options": {"KVGUARD_HANDOFF_TIMEOUT_S": LEASE_S}}


def _verdict(row: FaultRow) -> str:
    return "PASS" if row.passed else "FAIL"


def format_table(rows: list[FaultRow]) -> str:
    header = (
        f"{'fault':<15} {'reqs':>5} {'leaked':>6} {'wrong':>5} {'drained':>7} {'recovery s':>10}  "
        f"{'result':<6} errors during the fault (kind:code=n)"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        recovery = "never" if row.recovery_s is None else f"{row.recovery_s:.1f}"
        errors = ", ".join(f"{k}={v}" for k, v in row.during.items()) or "-"
        lines.append(
            f"{row.fault:<15} {row.requests:>5} {row.leaked_markers:>6} {row.wrong_content:>5} "
            f"{row.drained_pages:>7.0f} {recovery:>10}  {_verdict(row):<6} {errors}"
        )
        lines += [f"    ! {p}" for p in [*row.pool_violations, *row.audit_problems][:5]]
    return "\n".join(lines)


async def run_all(fs: FaultStack, names: list[str], **sizes: Any) -> list[FaultRow]:
    rows = []
    for name in names:
        rows.append(await SCENARIOS[name](fs, **sizes))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--only", nargs="*", choices=list(SCENARIOS), default=list(SCENARIOS))
    args = parser.parse_args(argv)
    with fault_stack(max_concurrency=max(4, args.clients), **stack_options()) as fs:
        rows = asyncio.run(run_all(fs, args.only, n_clients=args.clients))
    print()
    print(format_table(rows))
    for row in rows:
        recovery = "never" if row.recovery_s is None else f"{row.recovery_s:.1f} s"
        emit(
            "faults",
            f"{row.fault} under load: leaked markers, wrong content ({row.requests} requests "
            "during the fault), recovery",
            f"{row.leaked_markers}, {row.wrong_content}, {recovery}",
            "0, 0, recovers",
            row.passed,
        )
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
