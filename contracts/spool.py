"""A durable local spool: records kept on disk until the database has them.

What the gateway must not lose while its database is unreachable (canary findings, audit rows
pending at shutdown) is put here first. Lifecycle of a batch: ``put(records)`` (one JSON file,
written to a temporary name, fsynced, then renamed into place: a batch is on disk whole or not
at all) -> ``drain(write)`` (each file in age order is handed to ``write``; a file is removed only
after ``write`` returned, so a crash in between writes it again: at least once, and the writers
deduplicate) -> gone. A file that cannot be parsed is renamed ``*.bad`` and logged, never retried
for ever nor silently deleted.

``SpoolWriter`` is the background task that drains a spool as soon as something is put in it,
and again every interval while its writes fail.

Several processes may share a directory (two replicas with one data dir): ``put`` never collides
(unique names) and ``drain`` holds an exclusive ``flock`` on the directory's lock file, so one
process at a time writes; the lock dies with its holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio

from contracts import grid

log = logging.getLogger("kvguard.gateway.spool")

Record = dict[str, Any]


class Spool:
    def __init__(self, directory: Path, *, kind: str) -> None:
        self._dir = directory
        self._kind = kind

    @property
    def directory(self) -> Path:
        return self._dir

    def put(self, records: list[Record]) -> Path:
        """Keep ``records`` durably; returns the file holding them (raises OSError if it cannot)."""
        self._dir.mkdir(parents=True, exist_ok=True)
        name = f"{self._kind}-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
        final = self._dir / name
        temporary = self._dir / f".{name}.tmp"
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump(records, out, separators=(",", ":"))
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, final)
        _fsync_dir(self._dir)
        return final

    def pending(self) -> list[Path]:
        """This kind's files, oldest first."""
        if not self._dir.is_dir():
            return []
        return sorted(self._dir.glob(f"{self._kind}-*.json"))

    def drain(self, write: Callable[[list[Record]], None]) -> int:
        """Hand each file's records to ``write``, removing the file once it returns; stops at the
        first exception (which propagates; that file and later ones stay). Returns the records
        written."""
        if not self.pending():
            return 0
        written = 0
        with self._locked():
            for path in self.pending():  # again, under the lock: another process may have drained
                records = self._read(path)
                if records is None:
                    continue
                write(records)
                path.unlink(missing_ok=True)
                written += len(records)
        return written

    def _read(self, path: Path) -> list[Record] | None:
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error("spool file %s is unreadable (%s); kept as .bad", path.name, exc)
            path.rename(path.with_suffix(".bad"))
            return None
        if not isinstance(records, list):
            log.error("spool file %s does not hold a list; kept as .bad", path.name)
            path.rename(path.with_suffix(".bad"))
            return None
        return records

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self._dir.mkdir(parents=True, exist_ok=True)
        with open(self._dir / f".{self._kind}.lock", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolWriter:
    """A spool and the background task that writes it: the task drains the spool (in a worker
    thread) when it starts, whenever ``put`` keeps new records, and every ``interval_s`` (a
    failed write is retried then); ``settled`` waits, bounded, until a batch is written (it stays
    spooled otherwise)."""

    def __init__(
        self, spool: Spool, write: Callable[[list[Record]], None], *, interval_s: float
    ) -> None:
        self.spool = spool
        self._write = write
        self._interval_s = interval_s
        self._wake = asyncio.Event()
        self.after_drain: Callable[[], None] | None = None  # called after every clean drain

    def put(self, records: list[Record]) -> Path:
        path = self.spool.put(records)
        self._wake.set()
        return path

    async def settled(self, path: Path, timeout_s: float) -> bool:
        """Whether the batch in ``path`` was written within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while path.exists():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def run(self) -> None:
        """Drain until cancelled: no failure of one drain ends the task (records wait on disk
        for the next)."""
        while True:
            self._wake.clear()
            await self.drain_once()  # at once on start: what a previous run left behind
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(grid.deadline(self._interval_s)):
                    await self._wake.wait()

    async def drain_once(self) -> bool:
        """One drain; False (logged) when it failed and records wait for the next one. An empty
        spool is found so on the event loop (a stat of its directory, a listing once it exists):
        the usual drain, every ``interval_s`` of a replica's life, wakes no worker thread."""
        try:
            if self.spool.pending():
                await anyio.to_thread.run_sync(self.spool.drain, self._write)
        except Exception as exc:
            log.warning("%s not written yet (%s)", self._pending(), type(exc).__name__)
            return False
        if self.after_drain is not None:
            try:
                self.after_drain()
            except Exception:
                log.exception("after a drain of %s", self.spool.directory)
        return True

    def _pending(self) -> str:
        """How many batches wait, for a log line (the directory may fail to list too)."""
        try:
            return f"{len(self.spool.pending())} spooled batch(es)"
        except OSError as exc:
            return f"the spooled batches in {self.spool.directory} ({exc.strerror or exc})"
