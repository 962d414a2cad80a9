"""Random bytes from the operating system's CSPRNG (what ``secrets`` reads), read ahead 4 KiB at
a time: one system call per 4 KiB instead of one per draw, for what draws on every request (the
request id, the canary's sampling). Every byte is used once, and a forked child starts with
none of its parent's. For one thread (the event loop's): not thread-safe."""

from __future__ import annotations

import os
import weakref


class RandomBytes:
    __slots__ = ("__weakref__", "_at", "_buffer")
    SIZE = 4096

    def __init__(self) -> None:
        self._buffer = b""
        self._at = 0
        _ALL.add(self)

    def take(self, size: int) -> bytes:
        at = self._at
        if at + size > len(self._buffer):
            self._buffer, at = os.urandom(max(self.SIZE, size)), 0
        self._at = at + size
        return self._buffer[at : at + size]

    def _forget(self) -> None:
        self._buffer, self._at = b"", 0


_ALL: weakref.WeakSet[RandomBytes] = weakref.WeakSet()


def _forget_all() -> None:
    for source in list(_ALL):
        source._forget()


os.register_at_fork(after_in_child=_forget_all)
