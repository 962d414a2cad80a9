"""The spool writer (``contracts.spool.SpoolWriter``: the canary's findings, the gateway's
quarantine decisions) outlives a spool directory that fails for a while.

Reading the directory can fail with an OSError that is no "missing" (EIO, ESTALE when an NFS
server restarts, EACCES): the writer logged a failed drain by counting the pending files, which
read the directory again, raised again, and ended the writer's task -- findings and quarantines
then stayed on disk until the process restarted. The directory double here fails the listing
only (``Spool.pending``), as a stale NFS handle does; the files themselves are real.
"""

from __future__ import annotations

import asyncio
import errno
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
