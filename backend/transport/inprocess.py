"""An in-process transport for unit tests: both roles in one process, writes are memmoves.

It checks what Mooncake's server checks: every destination range must lie inside one region the
target registered, so a bad address fails the batch instead of corrupting the process.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

from backend.transport.base import KvTransport, Segment, TransferError

_REGISTRY: dict[str, dict[int, int]] = {}  # endpoint -> {address: length}
_LOCK = threading.Lock()
_IDS = itertools.count(1)


class InProcessTransport(KvTransport):
    name = "inprocess"

    def __init__(self) -> None:
        self._endpoint = f"inprocess:{next(_IDS)}"
        with _LOCK:
            _REGISTRY[self._endpoint] = {}

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, address: int, length: int) -> None:
        with _LOCK:
            _REGISTRY[self._endpoint][address] = length

    def unregister(self, address: int) -> None:
        with _LOCK:
            _REGISTRY.get(self._endpoint, {}).pop(address, None)

    def write(self, endpoint: str, segments: Sequence[Segment]) -> None:
        # The lock covers the copies: once ``unregister`` returns, nothing more lands there.
        with _LOCK:
            regions = _REGISTRY.get(endpoint)
            if regions is None:
                raise TransferError(f"no transport endpoint {endpoint!r}")
            for segment in segments:
                if not any(
                    base <= segment.dst and segment.dst + segment.length <= base + length
                    for base, length in regions.items()
                ):
                    raise TransferError(f"destination {segment.dst:#x} is not registered memory")
            for segment in segments:
                ctypes.memmove(segment.dst, segment.src, segment.length)

    def close(self) -> None:
        with _LOCK:
            _REGISTRY.pop(self._endpoint, None)
