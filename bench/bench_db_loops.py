"""The replica's periodic database work: CPU per key renewal and per audit flush, through a pooled
session on a worker thread against the loop's own connection (``gateway.db.link``).

Run: ``python -m bench.bench_db_loops [--ops N] [--gap-ms MS] [--rounds N]``. It starts a private
PostgreSQL (``kvguard.localservices``), migrates it, makes 10 tenants with a key each, pins itself
to one core (as ``bench.bench_relay`` pins a relay) and, in each round, runs every way in turn:
``--ops`` operations ``--gap-ms`` apart on uvloop (the spacing a replica's loops have, so each
finds the caches as it would in service):

- a renewal of the 10 keys: ``gateway.services.keys.renew`` in ``contracts.sql.run_in_session``
  (the gateway's way before issue 33's step 14), and ``renew_over`` on a ``Link`` (its way now);
- an audit flush of 5 rows (a replica's batch at 10 requests/s and the default half-second
  interval): ``AuditWriter`` without and with its link; and with its link, 5 rows and a key's
  last-use stamp (a key is stamped at most once per ``key_last_used_interval_s``, a minute by
  default, so the usual flush has none);
- the spacing alone (the loop's sleeps): what every row above includes.

Measured: the process's CPU (user + system, every thread) per operation, the median over rounds
with the range. The renewal and the flush are what a replica pays every half second whatever its
load, so at low rates they are a large part of each request's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import uvloop
from sqlalchemy import select

from bench.bench_audit_flush import audit_rows
from bench.relay_systems import pin_self
from bench.summary import emit
from contracts.sql import make_session_factory, run_in_session, session_scope
from gateway.db.link import Link
from gateway.db.models import ApiKey
from gateway.db.session import make_engine, upgrade_database
from gateway.domain import TenantPlan
from gateway.services.audit import AuditWriter
from gateway.services.keys import renew, renew_over
from gateway.services.tenants import create_tenant
from kvguard.localservices import postgres_server

ROWS = 5  # audit rows per flush


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _per_op_us(op: Callable[[], Awaitable[object]], ops: int, gap_s: float) -> float:
    for _ in range(3):  # connections made, statements cached
        await op()
    before = _cpu_s()
    for _ in range(ops):
        await asyncio.sleep(gap_s)
        await op()
    return (_cpu_s() - before) / ops * 1e6


async def measure(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    engine = make_engine(url, timeout_s=5.0)  # bounded, as the gateway's
    sessions = make_session_factory(engine, timeout_s=5.0)
    with session_scope(sessions) as session:
        for i in range(10):
            create_tenant(session, name=f"bench-{i}", plan=TenantPlan())
    with session_scope(sessions) as session:
        key_ids = list(session.scalars(select(ApiKey.id)))
    link = Link.of(engine, timeout_s=5.0)
    assert link is not None, "a PostgreSQL URL"
    plain = AuditWriter(session_factory=sessions, flush_interval_s=600)
    linked = AuditWriter(session_factory=sessions, flush_interval_s=600, link=link)

    async def renew_in_session() -> object:
        now = datetime.now(UTC)
        return await run_in_session(sessions, lambda s: renew(s, key_ids=key_ids, now=now))

    async def renew_on_link() -> object:
        return await renew_over(link, key_ids=key_ids, now=datetime.now(UTC))

    def flush_of(writer: AuditWriter, *, stamp: bool = False) -> Callable[[], Awaitable[object]]:
        async def flush() -> None:
            for row in audit_rows(ROWS):
                writer.record(row)
            if stamp:
                writer.touch_key(key_ids[0], datetime.now(UTC))
            await writer.flush()

        return flush

    async def nothing() -> None:
        return None

    ways: dict[str, Callable[[], Awaitable[object]]] = {
        "key renewal, session on a worker thread": renew_in_session,
        "key renewal, the loop's own connection": renew_on_link,
        f"audit flush ({ROWS} rows), session on a worker thread": flush_of(plain),
        f"audit flush ({ROWS} rows), the writer's own connection": flush_of(linked),
        f"audit flush ({ROWS} rows, 1 key stamp), the writer's own connection": flush_of(
            linked, stamp=True
        ),
        "the spacing alone": nothing,
    }
    found: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for _ in range(args.rounds):
            for name, op in ways.items():
                found[name].append(await _per_op_us(op, args.ops, args.gap_ms / 1000))
    finally:
        await link.close()
        engine.dispose()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    pin_self()
    with postgres_server() as pg:
        upgrade_database(make_engine(pg.url))
        found = uvloop.run(measure(pg.url, args))
    median = {name: statistics.median(values) for name, values in found.items()}
    print(
        f"python -m bench.bench_db_loops: {args.rounds} rounds of {args.ops} ops, "
        f"{args.gap_ms:g} ms apart; CPU µs per operation (median, range)"
    )
    print("| operation | CPU µs per op |")
    print("|---|---|")
    for name, values in found.items():
        print(f"| {name} | {median[name]:,.0f} ({min(values):,.0f}-{max(values):,.0f}) |")
    names = list(found)
    for kind, (before, after) in (("key renewal", names[0:2]), ("audit flush", names[2:4])):
        emit(
            "db_loops",
            f"{kind}: CPU per op, own connection / session",
            f"{median[after] / median[before]:.2f}x",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
