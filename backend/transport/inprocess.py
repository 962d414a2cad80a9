"""An in-process transport for unit tests: both roles in one process, writes are memmoves.

It checks what Mooncake's server checks: every destination range must lie inside memory the
target registered, so a bad address fails the batch instead of corrupting the process.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

from backend.transport.base import KvTransport, Segment, TransferError

_REGISTRY: dict[str, list[tuple[int, int]]] = {}
_LOCK = threading.Lock()
_IDS = itertools.count(1)


class InProcessTransport(KvTransport):
    name = "inprocess"

    def __init__(self) -> None:
        self._endpoint = f"inprocess:{next(_IDS)}"
        with _LOCK:
            _REGISTRY[self._endpoint] = []

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, address: int, length: int) -> None:
        with _LOCK:
            _REGISTRY[self._endpoint].append((address, length))

    def write(self, endpoint: str, segments: Sequence[Segment]) -> None:
        with _LOCK:
            regions = list(_REGISTRY.get(endpoint, ()))
        if not regions and endpoint not in _REGISTRY:
            raise TransferError(f"no transport endpoint {endpoint!r}")
        for segment in segments:
            if not any(
                base <= segment.dst and segment.dst + segment.length <= base + length
                for base, length in regions
            ):
                raise TransferError(f"destination {segment.dst:#x} is not registered memory")
        for segment in segments:
            ctypes.memmove(segment.dst, segment.src, segment.length)

    def close(self) -> None:
        with _LOCK:
            _REGISTRY.pop(self._endpoint, None)
