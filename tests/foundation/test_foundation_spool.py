"""The spool writer (``contracts.spool.SpoolWriter``: the canary's findings, the gateway's
quarantine decisions) outlives a spool directory that fails for a while, and drains an empty
spool without a worker thread.

Reading the directory can fail with an OSError that is no "missing" (EIO, ESTALE when an NFS
server restarts, EACCES): the writer logged a failed drain by counting the pending files, which
read the directory again, raised again, and ended the writer's task -- findings and quarantines
then stayed on disk until the process restarted. The directory double here fails the listing
only (``Spool.pending``), as a stale NFS handle does; the files themselves are real.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contracts.spool import Spool, SpoolWriter


async def test_a_spool_directory_that_fails_for_a_while_does_not_end_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[Any] = []
    spool = Spool(tmp_path / "spool", kind="finding")
    writer = SpoolWriter(spool, written.extend, interval_s=0.05)
    listing = Spool.pending
    broken = True

    def pending(self: Spool) -> list[Path]:
        if broken:
            raise OSError(errno.ESTALE, "Stale file handle")
        return listing(self)

    monkeypatch.setattr(Spool, "pending", pending)
    task = asyncio.create_task(writer.run())
    try:
        kept = writer.put([{"n": 1}])
        assert not await writer.settled(kept, 0.3)  # nothing can be drained meanwhile
        assert not task.done(), task.exception()
        broken = False
        later = writer.put([{"n": 2}])
        assert await writer.settled(kept, 10) and await writer.settled(later, 10)
        assert written == [{"n": 1}, {"n": 2}] and not task.done()
    finally:
        task.cancel()


async def test_an_empty_spool_is_drained_on_the_loop_and_a_kept_batch_in_a_worker_thread(
    tmp_path: Path,
) -> None:
    """The periodic drain of an empty spool (most of a replica's life) wakes no worker thread;
    a batch that was put is still written, off the event loop."""
    loop_thread = threading.get_ident()
    drained_in: list[int] = []

    class Counted(Spool):
        def drain(self, write: Callable[[list[Any]], None]) -> int:
            drained_in.append(threading.get_ident())
            return super().drain(write)

    written: list[Any] = []
    writer = SpoolWriter(Counted(tmp_path / "spool", kind="finding"), written.extend, interval_s=60)
    assert await writer.drain_once()  # no directory yet
    writer.spool.directory.mkdir()
    assert await writer.drain_once()  # a directory with no batch in it
    assert drained_in == []
    writer.spool.put([{"n": 1}])
    assert await writer.drain_once()
    assert written == [{"n": 1}]
    assert len(drained_in) == 1 and drained_in[0] != loop_thread
