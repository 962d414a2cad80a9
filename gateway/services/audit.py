"""Request audit rows and key last-use stamps, written in batches off the request path.

Lifecycle: the request path calls ``record()``/``touch_key()`` (no I/O, never blocks) -> a
background task flushes every ``flush_interval_s``, or as soon as ``FULL_BATCH`` rows wait ->
``close()`` flushes what is left at shutdown, and spools to local disk what it could not write
(``contracts.spool``), to be written by the next start. A flush is one COPY on PostgreSQL, one
multi-row INSERT elsewhere, and any key stamps in the same transaction: on PostgreSQL on the
writer's own connection on the event loop (``gateway.db.link``), else, and for a batch that needs
more care (below), through a session on a worker thread (``gateway.db.copy`` for the COPY). Either
way the flush holds the GIL while it builds the rows and the event loop waits for it, so a slow
flush shows up in every request's tail latency. That is why a full batch does not wait for the
interval: at 500 requests/s a half-second batch (250 rows, about 4 ms of CPU as an INSERT) set the
gateway's p99; batches of ``FULL_BATCH`` keep each flush short. After a failed flush the next one
waits the whole interval, however many rows wait.

Failures, by kind:

- the database is unreachable (``is_outage``): the batch stays pending for the next try
  (bounded: beyond ``max_pending`` the oldest are dropped and counted). A flush that failed may
  still have committed (the connection broke after the commit, before its answer), so the retry
  skips the rows the database already has: one row per request, even across an outage;
- the database refused something in the batch (a value it cannot store): the batch is split in
  halves until each refused row stands alone; those rows are *set aside*: counted
  (``on_set_aside``), logged at ERROR with their request ids, never retried for ever; every
  other row lands. One odd row can no longer stop the audit of a whole replica.

Values are made storable when recorded (``gateway.db.text.storable``: NUL and lone surrogates
replaced, cut to the column's length), so set-aside rows are for what nobody foresaw.

An ``AuditRecord`` holds metadata only: ids, counts, outcome, timings. No content field exists.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import datetime
from functools import partial
from operator import attrgetter
from typing import Any, cast

import anyio
import psycopg
from sqlalchemy import Connection, String, Table, insert, select
from sqlalchemy.orm import Session, sessionmaker

from contracts import grid
from contracts.spool import Record, Spool
from contracts.sql import is_outage, session_scope
from gateway.db.copy import copy_rows, copy_statement
from gateway.db.link import Link
from gateway.db.models import RequestAudit
from gateway.db.text import storable
from gateway.services.keys import touch_keys, touch_keys_on

log = logging.getLogger("kvguard.gateway.audit")
_ID_CHUNK = 500  # request ids per lookup (bounded statement size)
FULL_BATCH = 64  # rows: a flush starts as soon as so many wait
_TABLE = cast(Table, RequestAudit.__table__)


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

    def params(self) -> dict[str, Any]:
        """The record as an INSERT's parameters: its fields as they are (no deep copy, unlike
        ``dataclasses.asdict``: every value is an immutable scalar)."""
        return {name: getattr(self, name) for name in _FIELDS}

    def values(self) -> tuple[Any, ...]:
        """The record as a COPY row: its fields' values in field order. A naive time is refused,
        as the column's type refuses it in an INSERT (``contracts.sql.UTCDateTime``)."""
        if self.started_at.tzinfo is None:
            raise ValueError(f"audit row {self.request_id}: naive started_at")
        values: tuple[Any, ...] = _VALUES(self)
        return values

    def to_spool(self) -> Record:
        return {**self.params(), "started_at": self.started_at.isoformat()}

    @classmethod
    def from_spool(cls, raw: Record) -> AuditRecord:
        return cls(**{**raw, "started_at": datetime.fromisoformat(raw["started_at"])})


_FIELDS = tuple(f.name for f in fields(AuditRecord))
_VALUES = attrgetter(*_FIELDS)


def _text_limits() -> dict[str, int | None]:
    """Text fields of an audit row and the column length each is cut to."""
    limits: dict[str, int | None] = {}
    for f in fields(AuditRecord):
        column_type = RequestAudit.__table__.c[f.name].type
        if isinstance(column_type, String):
            limits[f.name] = column_type.length
    return limits


_TEXT_LIMITS = _text_limits()


def storable_record(record: AuditRecord) -> AuditRecord:
    """``record`` with every text field storable (see ``gateway.db.text``)."""
    changes: dict[str, Any] = {}
    for name, limit in _TEXT_LIMITS.items():
        value = getattr(record, name)
        if isinstance(value, str):
            fixed = storable(value, limit)
            if fixed != value:
                changes[name] = fixed
    return replace(record, **changes) if changes else record


class AuditWriter:
    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        flush_interval_s: float,
        max_pending: int = 100_000,
        on_drop: Callable[[], None] | None = None,
        on_set_aside: Callable[[], None] | None = None,
        spool: Spool | None = None,
        link: Link | None = None,
    ) -> None:
        self._factory = session_factory
        self._link = link  # PostgreSQL: the usual flush on the writer's own connection
        self._interval = flush_interval_s
        self._pending: deque[AuditRecord] = deque(maxlen=max_pending)
        self._touched: dict[int, datetime] = {}
        self._uncertain: set[str] = set()  # request ids whose failed flush may have committed
        self._lock = asyncio.Lock()
        self._full = asyncio.Event()  # FULL_BATCH rows wait
        self._on_drop = on_drop
        self._on_set_aside = on_set_aside
        self._spool = spool

    def record(self, record: AuditRecord) -> None:
        if len(self._pending) == self._pending.maxlen and self._on_drop is not None:
            self._on_drop()
        self._pending.append(storable_record(record))
        if len(self._pending) >= FULL_BATCH:
            self._full.set()

    def touch_key(self, key_id: int, at: datetime) -> None:
        self._touched[key_id] = at

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def run(self) -> None:
        early = True
        while True:
            await self._due(early=early)
            try:
                await self.flush()
                await self.drain_spool()
                early = True
            except Exception:  # keep the loop alive; the rows stay pending
                early = False  # a failing database is tried again after the whole interval
                log.exception("audit flush failed; will retry")

    async def _due(self, *, early: bool) -> None:
        """The flush interval (on the process's grid, ``contracts.grid``), cut short (when
        ``early``) by a full batch waiting."""
        if early:
            try:
                async with asyncio.timeout_at(grid.deadline(self._interval)):
                    await self._full.wait()
            except TimeoutError:
                pass
        else:
            await grid.sleep(self._interval)
        self._full.clear()

    async def flush(self) -> None:
        async with self._lock:
            rows, self._pending = self._pending, deque(maxlen=self._pending.maxlen)
            touched, self._touched = self._touched, {}
            if not rows and not touched:
                return
            uncertain = frozenset(self._uncertain)
            try:
                aside = await self._flushed(list(rows), touched, uncertain)
            except BaseException:
                self._pending.extendleft(reversed(rows))  # retried next time (oldest first)
                self._uncertain.update(row.request_id for row in rows)
                self._touched = {**touched, **self._touched}
                raise
            self._uncertain.clear()  # every uncertain row was in this batch (or was dropped)
        self._report(aside)

    async def _flushed(
        self, rows: list[AuditRecord], touched: dict[int, datetime], uncertain: frozenset[str]
    ) -> list[tuple[AuditRecord, str]]:
        """Write a batch; the rows set aside. The usual batch (PostgreSQL, no row uncertain) goes
        on the writer's link (``gateway.db.link``: on the event loop, no session, no worker
        thread): one COPY, or the COPY and the key stamps in one transaction. A batch the
        database refuses there (rolled back whole) goes through ``_write`` on a worker thread,
        which finds the refused rows by halves; so does every batch after an outage (it skips the
        rows already written)."""
        link = self._link
        if link is not None and not uncertain:
            write = partial(_copy_on, rows, touched)
            try:
                # rows alone are one statement (a COPY is atomic by itself: no BEGIN and COMMIT
                # round trips); with key stamps (a key's at most once per key_last_used_interval_s)
                # one transaction
                await (link.transaction(write) if touched else link.run(write))
                return []
            except Exception as exc:
                if is_outage(exc):
                    raise
        return await anyio.to_thread.run_sync(self._write, rows, touched, uncertain)

    async def drain_spool(self) -> None:
        """Write the rows a previous shutdown spooled (deduplicated: that flush may have landed)."""
        if self._spool is None or not self._spool.pending():
            return
        aside: list[tuple[AuditRecord, str]] = []

        def write(raw: list[Record]) -> None:
            rows = [AuditRecord.from_spool(item) for item in raw]
            aside.extend(self._write(rows, {}, frozenset(row.request_id for row in rows)))

        written = await anyio.to_thread.run_sync(self._spool.drain, write)
        log.info("audit: %d spooled rows written", written)
        self._report(aside)

    def _write(
        self, rows: list[AuditRecord], touched: dict[int, datetime], uncertain: frozenset[str]
    ) -> list[tuple[AuditRecord, str]]:
        """Write ``rows`` and the key stamps; returns the rows set aside (with why)."""
        try:
            self._write_batch(rows, touched, uncertain)
            return []
        except Exception as exc:
            if is_outage(exc) or len(rows) == 0:
                raise
        aside: list[tuple[AuditRecord, str]] = []
        self._write_batch([], touched, uncertain)  # stamps alone: ids and times, storable
        self._split(rows, uncertain, aside)
        return aside

    def _split(
        self,
        rows: list[AuditRecord],
        uncertain: frozenset[str],
        aside: list[tuple[AuditRecord, str]],
    ) -> None:
        half = len(rows) // 2
        for part in (rows[:half], rows[half:]):
            if not part:
                continue
            try:
                self._write_batch(part, {}, uncertain)
            except Exception as exc:
                if is_outage(exc):
                    raise
                if len(part) == 1:
                    aside.append((part[0], type(exc).__name__))
                else:
                    self._split(part, uncertain, aside)

    def _write_batch(
        self, rows: list[AuditRecord], touched: dict[int, datetime], uncertain: frozenset[str]
    ) -> None:
        with session_scope(self._factory) as session:
            if uncertain and rows:
                rows = _not_yet_written(session, rows, uncertain)
            if rows:
                _insert(session.connection(), rows)
            if touched:
                touch_keys(session, last_used=touched)

    def _report(self, aside: list[tuple[AuditRecord, str]]) -> None:
        for row, why in aside:
            if self._on_set_aside is not None:
                self._on_set_aside()
            log.error(
                "audit row of request %s (tenant %s) set aside: the database refused it (%s)",
                row.request_id,
                row.tenant_id,
                why,
            )

    async def close(self) -> None:
        try:
            await self.flush()
        except Exception as exc:
            self._spool_pending(exc)
        if self._link is not None:
            await self._link.close()

    def _spool_pending(self, exc: Exception) -> None:
        rows = list(self._pending)
        if not rows:
            return
        if self._spool is None:
            log.error("final audit flush failed (%s); %d rows lost", type(exc).__name__, len(rows))
            return
        try:
            path = self._spool.put([row.to_spool() for row in rows])
        except OSError as spool_exc:
            log.error("final audit flush failed; %d rows not spooled: %s", len(rows), spool_exc)
            return
        self._pending.clear()
        log.warning(
            "final audit flush failed (%s); %d rows spooled to %s for the next start",
            type(exc).__name__,
            len(rows),
            path,
        )


def _insert(connection: Connection, rows: list[AuditRecord]) -> None:
    """The rows in one statement: COPY on PostgreSQL (``gateway.db.copy``: the flush holds the
    GIL, and COPY builds the rows in C), else one multi-row INSERT (Core on the table)."""
    if connection.dialect.name == "postgresql":
        copy_rows(connection, _TABLE, _FIELDS, (row.values() for row in rows))
    else:
        connection.execute(insert(_TABLE), [row.params() for row in rows])


_COPY = copy_statement(_TABLE, _FIELDS).as_bytes()  # composed once, not on every flush


async def _copy_on(
    rows: list[AuditRecord], touched: dict[int, datetime], conn: psycopg.AsyncConnection[Any]
) -> None:
    """``_write_batch`` on a link's connection (no row uncertain): the COPY alone in autocommit,
    or inside the link's transaction with the key stamps."""
    if rows:
        async with conn.cursor() as cursor, cursor.copy(_COPY) as copy:
            for row in rows:
                await copy.write_row(row.values())
    await touch_keys_on(conn, last_used=touched)


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
