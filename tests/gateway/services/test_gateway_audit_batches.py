"""The audit writer does not hold a full batch for the whole interval (``FULL_BATCH`` rows start
a flush at once: a half-second batch at 500 requests/s held the gateway's core for ~4 ms and set
its p99), except after a failed flush: then it waits the interval, however many rows wait."""

from __future__ import annotations

import asyncio

from sqlalchemy import func, select

from contracts.sql import make_session_factory, session_scope
from gateway.db.models import RequestAudit
from gateway.db.session import make_engine, upgrade_database
from gateway.services.audit import FULL_BATCH, AuditWriter
from kvguard.localservices import free_port
from tests.gateway.audit_rows import audit_record


class Flushes:
    """Counts a writer's flushes as they start, and signals each one's end."""

    def __init__(self, writer: AuditWriter) -> None:
        self.started = 0
        self.ended = asyncio.Event()
        original = writer.flush

        async def flush() -> None:
            self.started += 1
            try:
                await original()
            finally:
                self.ended.set()

        writer.flush = flush  # type: ignore[method-assign]


async def test_a_full_batch_is_written_without_waiting_for_the_interval(postgres_url) -> None:
    engine = make_engine(postgres_url)
    upgrade_database(engine)
    factory = make_session_factory(engine)
    writer = AuditWriter(session_factory=factory, flush_interval_s=600)
    flushes = Flushes(writer)
    task = asyncio.create_task(writer.run())
    try:
        for n in range(FULL_BATCH):
            writer.record(audit_record(f"req-{n}"))
        await asyncio.wait_for(flushes.ended.wait(), timeout=30)  # not 600 s
        with session_scope(factory) as session:
            assert session.scalar(select(func.count()).select_from(RequestAudit)) == FULL_BATCH
        assert writer.pending == 0 and flushes.started == 1
    finally:
        task.cancel()
        engine.dispose()


async def test_after_a_failed_flush_a_full_batch_waits_the_interval() -> None:
    engine = make_engine(f"postgresql+psycopg://kvguard@127.0.0.1:{free_port()}/none")
    writer = AuditWriter(session_factory=make_session_factory(engine), flush_interval_s=600)
    flushes = Flushes(writer)
    task = asyncio.create_task(writer.run())
    try:
        for n in range(FULL_BATCH):
            writer.record(audit_record(f"req-{n}"))
        await asyncio.wait_for(flushes.ended.wait(), timeout=30)  # refused: nothing listens
        assert flushes.started == 1 and writer.pending == FULL_BATCH  # kept for the retry
        for n in range(FULL_BATCH, 2 * FULL_BATCH):
            writer.record(audit_record(f"req-{n}"))
        for _ in range(100):  # a flush begun early would have started within these turns
            await asyncio.sleep(0)
        assert flushes.started == 1
    finally:
        task.cancel()
        engine.dispose()
