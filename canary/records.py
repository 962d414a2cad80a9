"""Marker issue records: which request, tenant and engine a marker nonce was issued for.

Lifecycle of a record: ``put(replace=False)`` when a marker is injected (or a probe's marker is
seen in a request; the engine is not chosen yet) -> ``put`` again with the engine once the request
ends -> ``get`` when a finding names the nonce (to link the victim's request) -> expires after the
TTL. The first write never replaces, so the two writes may land in either order.

Stores: ``RedisRecordStore`` (shared by every gateway replica; production) and
``MemoryRecordStore`` (one process, bounded; the embedded default). A record holds ids and a
time, never marker text; the key is the nonce (8 random bytes), which alone proves nothing.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from contracts.resp import Arg, RespClient, RespError

MAX_MEMORY_RECORDS = 200_000
REDIS_PREFIX = "kvguard:canary:marker:"


@dataclass(frozen=True, slots=True)
class MarkerRecord:
    nonce: bytes = field(repr=False)
    request_id: str
    tenant_id: str
    engine: str | None
    issued_at: datetime

    def to_json(self) -> str:
        return json.dumps(
            {
                "request_id": self.request_id,
                "tenant_id": self.tenant_id,
                "engine": self.engine,
                "issued_at": self.issued_at.isoformat(),
            }
        )

    @classmethod
    def from_json(cls, nonce: bytes, text: str | bytes) -> MarkerRecord:
        raw: dict[str, Any] = json.loads(text)
        return cls(
            nonce=nonce,
            request_id=str(raw["request_id"]),
            tenant_id=str(raw["tenant_id"]),
            engine=raw.get("engine"),
            issued_at=datetime.fromisoformat(raw["issued_at"]).astimezone(UTC),
        )


class RecordStore(ABC):
    @abstractmethod
    async def put(self, record: MarkerRecord, *, replace: bool = True) -> None:
        """Store the record of ``record.nonce`` for the TTL (``replace=False``: only if absent)."""

    @abstractmethod
    async def get(self, nonce: bytes) -> MarkerRecord | None:
        """The record of ``nonce``, or None if unknown or expired."""

    async def close(self) -> None:
        return None


class MemoryRecordStore(RecordStore):
    """In-process records, oldest dropped first beyond ``max_records`` or after ``ttl_s``."""

    def __init__(
        self, *, ttl_s: float, max_records: int = MAX_MEMORY_RECORDS, clock: Any = time.monotonic
    ) -> None:
        self._ttl_s = ttl_s
        self._max = max_records
        self._clock = clock
        self._records: OrderedDict[bytes, tuple[float, MarkerRecord]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    async def put(self, record: MarkerRecord, *, replace: bool = True) -> None:
        now = self._clock()
        if not replace and await self.get(record.nonce) is not None:
            return
        self._records.pop(record.nonce, None)
        self._records[record.nonce] = (now + self._ttl_s, record)
        self._prune(now)

    async def get(self, nonce: bytes) -> MarkerRecord | None:
        entry = self._records.get(nonce)
        if entry is None or entry[0] <= self._clock():
            return None
        return entry[1]

    def _prune(self, now: float) -> None:
        while self._records:
            nonce, (expires, _) = next(iter(self._records.items()))
            if expires > now and len(self._records) <= self._max:
                return
            del self._records[nonce]


class RedisRecordStore(RecordStore):
    """Records as Redis strings with an expiry: every replica sees every replica's markers.
    Written over ``contracts.resp`` (one pipelined connection, as the limiter's): a marked
    request's record is one command's bytes and one reply, not redis-py's pool and layers."""

    def __init__(self, *, url: str, ttl_s: float, timeout_s: float = 2.0) -> None:
        self._client = RespClient(url, timeout_s=timeout_s)
        self._ttl_ms = max(1, int(ttl_s * 1000))

    async def put(self, record: MarkerRecord, *, replace: bool = True) -> None:
        key, value = _key(record.nonce), record.to_json()
        command: list[Arg] = ["SET", key, value, "PX", self._ttl_ms]
        if not replace:
            command.append("NX")  # the first write never replaces the completed record
        await self._client.execute(*command)

    async def get(self, nonce: bytes) -> MarkerRecord | None:
        raw = await self._client.execute("GET", _key(nonce))
        if raw is not None and not isinstance(raw, bytes):
            raise RespError(f"GET answered a {type(raw).__name__}")
        return None if raw is None else MarkerRecord.from_json(nonce, raw)

    async def close(self) -> None:
        await self._client.close()


def _key(nonce: bytes) -> str:
    return REDIS_PREFIX + nonce.hex()
