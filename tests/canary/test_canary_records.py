"""Marker issue records: TTL, bounded memory, first write never replaces; Redis and in-process."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from canary.records import MarkerRecord, MemoryRecordStore, RedisRecordStore

AT = datetime(2026, 9, 17, 12, 0, tzinfo=UTC)


def rec(nonce: bytes, engine: str | None = None, request: str = "r1") -> MarkerRecord:
    return MarkerRecord(
        nonce=nonce, request_id=request, tenant_id="t1", engine=engine, issued_at=AT
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_memory_store_expires_and_stays_bounded() -> None:
    clock = Clock()
    store = MemoryRecordStore(ttl_s=10, max_records=3, clock=clock)
    await store.put(rec(b"n0"))
    clock.now = 5
    for n in (b"n1", b"n2", b"n3"):
        await store.put(rec(n))
    assert len(store) == 3 and await store.get(b"n0") is None  # oldest dropped at the cap
    clock.now = 15.5
    assert await store.get(b"n1") is None  # expired
    await store.put(rec(b"n4"))
    assert len(store) == 1 and (await store.get(b"n4")).tenant_id == "t1"


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        yield MemoryRecordStore(ttl_s=60)
        return
    redis_store = RedisRecordStore(url=request.getfixturevalue("redis_url"), ttl_s=60)
    yield redis_store
    await redis_store.close()


async def test_first_write_never_replaces_the_completed_record(store) -> None:
    await store.put(rec(b"n1", engine="e1"), replace=True)  # the end-of-request write won the race
    await store.put(rec(b"n1", engine=None), replace=False)
    got = await store.get(b"n1")
    assert (got.request_id, got.tenant_id, got.engine, got.issued_at) == ("r1", "t1", "e1", AT)
    await store.put(rec(b"n2"), replace=False)
    await store.put(rec(b"n2", engine="e2"))
    assert (await store.get(b"n2")).engine == "e2"
    assert await store.get(b"unknown") is None
    assert "n1" not in repr(got) and repr(b"n1") not in repr(got)


async def test_redis_records_expire(redis_url) -> None:
    import redis

    store = RedisRecordStore(url=redis_url, ttl_s=30)
    await store.put(rec(b"\x01" * 8))
    ttl = redis.Redis.from_url(redis_url).pttl("kvguard:canary:marker:" + "01" * 8)
    assert 29_000 < ttl <= 30_000
    await store.close()
