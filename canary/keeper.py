"""Findings kept durably until the database has them.

A finding is put on local disk first (``contracts.spool``, one file per batch, fsynced),
then written to ``canary_findings`` by a background writer that retries while the database is
unreachable; the file goes once the rows are in. ``keep`` waits, bounded by the database's own
timeout, for its batch to land, so with a healthy database a finding is queryable by the time
the response that caused it has ended; with PostgreSQL down it stays spooled (it survives a
restart) and lands when the database answers. A batch written again after a crash between the
write and the clean-up is recognised (``stored_already``) and not stored twice.

Only if the local disk refuses the file too is a finding lost: then it is written directly
(bounded), and failing that it is logged at ERROR with its ids and counted
(``kvguard_canary_findings_lost_total``): never silently dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from canary.findings import NewFinding, store_finding, stored_already
from canary.metrics import CanaryMetrics
from contracts.spool import Spool, SpoolWriter
from contracts.sql import run_in_session, session_scope

log = logging.getLogger("kvguard.canary")


class FindingKeeper:
    def __init__(
        self,
        *,
        spool_dir: Path,
        sessions: sessionmaker[Session],
        timeout_s: float,
        retry_s: float,
        metrics: CanaryMetrics,
    ) -> None:
        self._sessions = sessions
        self._timeout_s = timeout_s
        self._metrics = metrics
        spool = Spool(spool_dir, kind="findings")
        self.writer = SpoolWriter(spool, self._write, interval_s=retry_s)

    async def keep(self, findings: list[NewFinding]) -> bool:
        """Keep ``findings`` (spooled at once); True when they are in the database already."""
        records = [f.to_record() for f in findings]
        try:
            path = self.writer.put(records)
        except OSError as exc:
            log.error("canary: findings not spooled (%s); writing them directly", exc)
            return await self._write_directly(records)
        return await self.writer.settled(path, self._timeout_s)

    async def run(self) -> None:
        await self.writer.run()

    async def _write_directly(self, records: list[dict[str, Any]]) -> bool:
        try:
            await run_in_session(self._sessions, lambda s: self._store(s, records))
        except Exception as exc:
            for raw in records:
                self._metrics.findings_lost.inc()
                log.error(
                    "canary finding LOST (%s): kind=%s observer_request=%s victim_request=%s",
                    type(exc).__name__,
                    raw["kind"],
                    raw["observer_request_id"],
                    raw["victim_request_id"],
                )
            return False
        return True

    def _write(self, records: list[dict[str, Any]]) -> None:
        with session_scope(self._sessions) as session:
            self._store(session, records)

    @staticmethod
    def _store(session: Session, records: list[dict[str, Any]]) -> None:
        for raw in records:
            finding = NewFinding.from_record(raw)
            if not stored_already(session, finding):
                store_finding(session, finding)
