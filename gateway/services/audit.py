"""Request audit rows and key last-use stamps, written in batches off the request path.

Lifecycle: the request path calls ``record()``/``touch_key()`` (no I/O, never blocks) -> a
background task flushes every ``flush_interval_s`` in a worker thread -> ``close()`` flushes what
is left at shutdown. A flush is one bulk INSERT (Core, not ORM objects): the worker thread holds
the GIL while it builds the statement, and the event loop waits for it, so a slow flush shows up
in every request's tail latency (ORM objects cost about three times as much CPU per row here).
A crash loses at most one interval of rows; a failed flush keeps its rows for the next try
(bounded: beyond ``max_pending`` the oldest are dropped and counted). A flush that failed may
still have committed (the connection broke after the commit, before its answer), so the retry
skips the rows the database already has: one row per request, even across an outage.

An ``AuditRecord`` holds metadata only: ids, counts, outcome, timings. No text field exists.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime

import anyio
from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import RequestAudit
from gateway.db.session import session_scope
from gateway.services.keys import touch_keys

log = logging.getLogger("kvguard.gateway.audit")
_ID_CHUNK = 500  # request ids per lookup (bounded statement size)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    request_id: str
    tenant_id: str
    key_prefix: str | None
    endpoint: str
    model: str | None
    engine: str | None
    stream: bool
    prompt_tokens: int | None
    max_tokens: int | None
    completion_tokens: int | None
    outcome: str
    http_status: int
    error_code: str | None
    handoff_outcome: str | None
    reserved_tokens: int | None
    transferred_tokens: int | None
    started_at: datetime
    ttft_ms: float | None
    duration_ms: float


class AuditWriter:
    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        flush_interval_s: float,
        max_pending: int = 100_000,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self._factory = session_factory
        self._interval = flush_interval_s
        self._pending: deque[AuditRecord] = deque(maxlen=max_pending)
        self._touched: dict[int, datetime] = {}
        self._uncertain: set[str] = set()  # request ids whose failed flush may have committed
        self._lock = asyncio.Lock()
        self._on_drop = on_drop

    def record(self, record: AuditRecord) -> None:
        if len(self._pending) == self._pending.maxlen and self._on_drop is not None:
            self._on_drop()
        self._pending.append(record)

    def touch_key(self, key_id: int, at: datetime) -> None:
        self._touched[key_id] = at

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.flush()
            except Exception:  # keep the loop alive; the rows stay pending
                log.exception("audit flush failed; will retry")

    async def flush(self) -> None:
        async with self._lock:
            rows, self._pending = self._pending, deque(maxlen=self._pending.maxlen)
            touched, self._touched = self._touched, {}
            if not rows and not touched:
                return
            uncertain = frozenset(self._uncertain)
            try:
                await anyio.to_thread.run_sync(self._write, list(rows), touched, uncertain)
            except BaseException:
                self._pending.extendleft(reversed(rows))  # retried next time (oldest first)
                self._uncertain.update(row.request_id for row in rows)
                self._touched = {**touched, **self._touched}
                raise
            self._uncertain.clear()  # every uncertain row was in this batch (or was dropped)

    def _write(
        self, rows: list[AuditRecord], touched: dict[int, datetime], uncertain: frozenset[str]
    ) -> None:
        with session_scope(self._factory) as session:
            if uncertain:
                rows = _not_yet_written(session, rows, uncertain)
            if rows:  # one multi-row INSERT: no ORM objects (a flush holds the GIL briefly)
                session.execute(insert(RequestAudit), [asdict(row) for row in rows])
            touch_keys(session, last_used=touched)

    async def close(self) -> None:
        try:
            await self.flush()
        except Exception:
            log.exception("final audit flush failed; %d rows lost", len(self._pending))


def _not_yet_written(
    session: Session, rows: list[AuditRecord], uncertain: frozenset[str]
) -> list[AuditRecord]:
    """``rows`` without those of ``uncertain`` ids the database already holds."""
    ids = [row.request_id for row in rows if row.request_id in uncertain]
    found: set[str] = set()
    for start in range(0, len(ids), _ID_CHUNK):
        chunk = ids[start : start + _ID_CHUNK]
        query = select(RequestAudit.request_id).where(RequestAudit.request_id.in_(chunk))
        found.update(session.scalars(query))
    return [row for row in rows if row.request_id not in found]
