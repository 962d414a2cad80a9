"""The audit writer's flush on PostgreSQL: CPU per batch, COPY against a multi-row INSERT.

Run: ``python -m bench.bench_audit_flush [--batches N] [--rounds N]``. It starts a private
PostgreSQL (``kvguard.localservices``), migrates it, and writes batches of audit rows
(``gateway.services.audit.AuditRecord``) the two ways the writer can: one COPY
(``gateway.db.copy``, what the writer does on PostgreSQL) and one Core multi-row INSERT (what it
did before, and still does on SQLite), alternating batch by batch. Each batch is a whole unit of
work as the writer runs it: a session, the pool's checkout ping, the rows, the commit. What is
measured is the writing thread's CPU (``time.thread_time``): the time the flush holds the GIL
while requests wait. PostgreSQL's own CPU is another process's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import fields
from datetime import UTC, datetime
from typing import cast

from sqlalchemy import Connection, Table, insert

from bench.summary import emit
from contracts.sql import make_session_factory, session_scope
from gateway.db.copy import copy_rows
from gateway.db.models import RequestAudit
from gateway.db.session import make_engine, upgrade_database
from gateway.services.audit import AuditRecord
from kvguard.localservices import postgres_server

SIZES = (64, 250)
TABLE = cast(Table, RequestAudit.__table__)
COLUMNS = tuple(f.name for f in fields(AuditRecord))


def audit_rows(n: int) -> list[AuditRecord]:
    """``n`` audit rows of completed chat completions, every field set, each its own id."""
    now = datetime.now(UTC)
    return [
        AuditRecord(
            request_id=uuid.uuid4().hex,
            tenant_id="tn_0123456789abcdef",
            key_prefix="0123456789ab",
            endpoint="chat",
            model="kvguard-tiny",
            engine="engine-0",
            stream=bool(i % 2),
            prompt_tokens=24,
            max_tokens=64,
            completion_tokens=64,
            outcome="completed",
            http_status=200,
            error_code=None,
            handoff_outcome=None,
            reserved_tokens=None,
            transferred_tokens=None,
            started_at=now,
            ttft_ms=3.2,
            duration_ms=640.5,
        )
        for i in range(n)
    ]


def _by_insert(connection: Connection, rows: list[AuditRecord]) -> None:
    connection.execute(insert(TABLE), [row.params() for row in rows])


def _by_copy(connection: Connection, rows: list[AuditRecord]) -> None:
    copy_rows(connection, TABLE, COLUMNS, (row.values() for row in rows))


WAYS: dict[str, Callable[[Connection, list[AuditRecord]], None]] = {
    "INSERT": _by_insert,
    "COPY": _by_copy,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="per way and size")
    args = parser.parse_args(argv)
    taken: dict[tuple[int, str], list[float]] = {}
    with postgres_server() as pg:
        engine = make_engine(pg.url, timeout_s=5.0)  # bounded, as the gateway's
        upgrade_database(engine)
        factory = make_session_factory(engine)
        try:
            for size in SIZES:
                for n in range(args.batches + 5):  # the first 5 of each warm up
                    for way, write in WAYS.items():
                        rows = audit_rows(size)
                        started = time.thread_time()
                        with session_scope(factory) as session:
                            write(session.connection(), rows)
                        if n >= 5:
                            taken.setdefault((size, way), []).append(time.thread_time() - started)
        finally:
            engine.dispose()
    print("| rows per batch | INSERT CPU ms (p50) | COPY CPU ms (p50) | COPY / INSERT |")
    print("|---|---|---|---|")
    ratios = {}
    for size in SIZES:
        by_insert = statistics.median(taken[(size, "INSERT")])
        by_copy = statistics.median(taken[(size, "COPY")])
        ratios[size] = by_copy / by_insert
        print(f"| {size} | {by_insert * 1e3:.2f} | {by_copy * 1e3:.2f} | {ratios[size]:.2f}x |")
    emit(
        "audit_flush",
        f"audit flush CPU per {SIZES[0]}-row batch, COPY / INSERT",
        f"{ratios[SIZES[0]]:.2f}x",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
