"""``contracts.randomness``: random bytes read ahead from the OS, each used once, never shared with
a forked child (which would otherwise draw the parent's next request ids and sampling draws)."""

from __future__ import annotations

import os

import pytest

from contracts.randomness import RandomBytes


def test_bytes_are_read_4_kib_at_a_time_and_each_used_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    counter = iter(range(10**9))

    def urandom(size: int) -> bytes:
        reads.append(size)
        return bytes(next(counter) % 256 for _ in range(size))

    monkeypatch.setattr(os, "urandom", urandom)
    source = RandomBytes()
    drawn = b"".join(source.take(16) for _ in range(513))  # 256 ids per read
    assert reads == [4096, 4096, 4096]
    assert drawn == bytes(n % 256 for n in range(513 * 16))
    assert len(source.take(5000)) == 5000 and reads[-1] == 5000  # larger than a read: one read


def test_a_forked_child_never_draws_its_parents_bytes() -> None:
    source = RandomBytes()
    source.take(16)  # the buffer is read: the parent's next 16 bytes are in memory
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.close(read_end)
        os.write(write_end, source.take(16))
        os._exit(0)
    os.close(write_end)
    ours = source.take(16)
    theirs = os.read(read_end, 16)
    os.close(read_end)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(theirs) == 16 and theirs != ours
