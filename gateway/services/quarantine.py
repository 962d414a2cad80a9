"""Quarantine: taking an engine out of routing on every replica, without waiting on PostgreSQL.

Lifecycle of a quarantine (``Quarantines.impose``, by the canary on a leak or by an admin):

1. this replica stops routing to the engine at once (its registry, in memory);
2. the decision is spooled to local disk (``contracts.spool``): it survives a restart;
3. with Redis: the key ``kvguard:quarantine:<engine>`` is set and a message published on
   ``kvguard:quarantines``; every replica's subscriber applies it at once, and a replica whose
   subscription was down reads the keys on its next engine reload (every poll interval);
4. a background writer records it in ``engine_controls`` (the admin record, read by every
   replica's reload), retrying while PostgreSQL is unreachable; the spool file goes once written.
   ``impose`` waits for that write up to the database's own bound, so with a healthy database
   the row is there when it returns; it never waits longer.

Every reload applies the union of the database's quarantines, the Redis keys and this replica's
not-yet-written ones, so no source that lags can lift a quarantine; and a quarantine applied here
while a reload was reading (imposed, or learned from another replica's message) is applied again
once the reload is done (``applied``, ``reapply``): a reload's read that began before it, and
found neither the row nor the key, must not lift it. Clearing (an admin) deletes
the Redis key and clears the row, or fails with 503 (``QuarantineUnclear``) and changes nothing
that would lift it: relaxing isolation never happens half-way. A spooled quarantine older than
the row's last change (an admin cleared it since) is not written again.

Failure modes: Redis down when a quarantine is imposed -- the others learn it from PostgreSQL on
their next reload; both down -- only the replica that imposed it stops routing until one of them
answers (its spool replays then); a replica that cannot reach Redis for its subscription falls
back to its reloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy.orm import Session, sessionmaker

from contracts.spool import Record, Spool, SpoolWriter
from contracts.sql import run_in_session, session_scope, utcnow
from gateway.engines.registry import EngineControls, EngineRegistry
from gateway.errors import ServiceUnavailable
from gateway.services import engines as engine_service

log = logging.getLogger("kvguard.gateway.quarantine")
KEY_PREFIX = "kvguard:quarantine:"
CHANNEL = "kvguard:quarantines"
REDIS_TIMEOUT_S = 0.5


class QuarantineUnclear(ServiceUnavailable):
    code = "quarantine_not_cleared"


@dataclass(frozen=True, slots=True)
class Decision:
    engine: str
    reason: str
    at: datetime

    def record(self) -> Record:
        return {"engine": self.engine, "reason": self.reason, "at": self.at.isoformat()}

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Decision:
        return cls(str(raw["engine"]), str(raw["reason"]), datetime.fromisoformat(raw["at"]))


class Quarantines:
    def __init__(
        self,
        *,
        registry: EngineRegistry,
        sessions: sessionmaker[Session],
        spool: Spool,
        redis_url: str | None,
        retry_s: float,
        write_timeout_s: float,
    ) -> None:
        self._registry = registry
        self._write_timeout_s = write_timeout_s
        self._sessions = sessions
        self._writer = SpoolWriter(spool, self._write_rows, interval_s=retry_s)
        self._writer.after_drain = self._pending_written
        self._pending: dict[str, Decision] = {}  # imposed here, not yet in the database
        self._applied = 0  # how many times a quarantine or its lifting was applied here
        self._live: dict[str, tuple[int, str]] = {}  # engine -> (the count then, reason), in force
        self._redis: Any = None
        self._listener: Any = None
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.Redis.from_url(
                redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
            )
            self._listener = aioredis.Redis.from_url(redis_url, health_check_interval=5)

    # -- imposing and clearing -------------------------------------------------------------------

    async def impose(self, engine: str, *, reason: str) -> bool:
        """Stop routing to ``engine`` here now, and on every replica as soon as it can learn;
        True once the database has it too (waited for up to ``write_timeout_s``; else it is
        written in the background when the database answers)."""
        decision = Decision(engine, reason, utcnow())
        self._apply(engine, reason)
        self._pending[engine] = decision
        try:
            path = self._writer.put([decision.record()])
        except OSError as exc:  # the disk: the database write below is then the only record
            log.error("quarantine of %s not spooled (%s); writing it directly", engine, exc)
            await self._broadcast(engine, reason)
            await run_in_session(self._sessions, lambda s: self._write_one(s, decision))
            return True
        await self._broadcast(engine, reason)
        return await self._writer.settled(path, self._write_timeout_s)

    async def clear(
        self, engine: str, *, also: Callable[[Session], object] | None = None
    ) -> EngineControls:
        """Lift a quarantine everywhere (an admin), or raise without lifting it anywhere;
        ``also`` runs in the unit of work that clears the row (the operator's audit record)."""
        if self._redis is not None:
            try:
                await self._redis.delete(KEY_PREFIX + engine)
                await self._redis.publish(CHANNEL, json.dumps({"engine": engine, "reason": None}))
            except (RedisError, OSError) as exc:
                raise QuarantineUnclear(
                    "Redis is unreachable: the quarantine cannot be lifted on every replica; "
                    "retry when it answers."
                ) from exc

        def lift(session: Session) -> EngineControls:
            controls = engine_service.clear_quarantine(session, name=engine)
            if also is not None:
                also(session)
            return controls

        controls = await run_in_session(self._sessions, lift)
        self._pending.pop(engine, None)
        self._live.pop(engine, None)
        self._registry.set_controls(engine, controls)
        return controls

    # -- what every reload applies ---------------------------------------------------------------

    def applied(self) -> int:
        """A mark to give ``reapply`` (taken before a reload reads anything)."""
        return self._applied

    def reapply(self, since: int) -> None:
        """Apply again every quarantine applied here after the mark ``since`` (and not lifted
        since): called when a reload that began at ``since`` has set the registry."""
        for engine, (count, reason) in list(self._live.items()):
            if count > since:
                self._set(engine, reason)

    async def overlay(self) -> dict[str, str]:
        """engine -> reason of every quarantine the database may not show yet: the Redis keys and
        this replica's unwritten ones (a reload merges them into the database's)."""
        found = {d.engine: d.reason for d in self._pending.values()}
        if self._redis is None:
            return found
        try:
            keys = [k async for k in self._redis.scan_iter(match=KEY_PREFIX + "*", count=100)]
            values = await self._redis.mget(keys) if keys else []
        except (RedisError, OSError) as exc:
            log.warning("quarantine keys not read (%s): the database's alone apply", exc)
            return found
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                name = (key.decode() if isinstance(key, bytes) else key).removeprefix(KEY_PREFIX)
                found.setdefault(name, _reason(value))
        return found

    # -- background work -------------------------------------------------------------------------

    async def run(self) -> None:
        """Write spooled decisions to the database; follow other replicas' decisions."""
        tasks = [asyncio.create_task(self._writer.run(), name="quarantine-writer")]
        if self._listener is not None:
            tasks.append(asyncio.create_task(self._follow(), name="quarantine-follower"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def close(self) -> None:
        for client in (self._redis, self._listener):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()

    async def _follow(self) -> None:
        while True:
            try:
                async with self._listener.pubsub() as pubsub:
                    await pubsub.subscribe(CHANNEL)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._on_message(message["data"])
            except (RedisError, OSError) as exc:
                log.warning("quarantine messages not followed (%s); retrying", exc)
            await asyncio.sleep(1.0)

    def _on_message(self, data: bytes | str) -> None:
        try:
            raw = json.loads(data)
            engine, reason = str(raw["engine"]), raw.get("reason")
        except (ValueError, KeyError, TypeError):
            log.warning("unreadable quarantine message ignored")
            return
        if reason is None:
            if engine not in self._pending:
                self._apply(engine, None)
        else:
            self._apply(engine, str(reason))

    async def _broadcast(self, engine: str, reason: str) -> None:
        if self._redis is None:
            return
        value = json.dumps({"reason": reason, "at": utcnow().isoformat()})
        try:
            await self._redis.set(KEY_PREFIX + engine, value)
            await self._redis.publish(CHANNEL, json.dumps({"engine": engine, "reason": reason}))
        except (RedisError, OSError) as exc:
            log.error(
                "quarantine of %s not broadcast (%s): other replicas learn it from the database",
                engine,
                exc,
            )

    def _apply(self, engine: str, reason: str | None) -> None:
        self._applied += 1
        if reason is None:
            self._live.pop(engine, None)
        else:
            self._live[engine] = (self._applied, reason)
        self._set(engine, reason)

    def _set(self, engine: str, reason: str | None) -> None:
        record = self._registry.get(engine)
        allow = record.controls.allow_unsafe if record is not None else False
        self._registry.set_controls(
            engine, EngineControls(quarantine_reason=reason, allow_unsafe=allow)
        )

    def _write_rows(self, records: list[Record]) -> None:
        with session_scope(self._sessions) as session:
            for raw in records:
                self._write_one(session, Decision.of(raw))

    @staticmethod
    def _write_one(session: Session, decision: Decision) -> None:
        engine_service.quarantine(
            session, name=decision.engine, reason=decision.reason, at=decision.at
        )

    def _pending_written(self) -> None:
        if not self._writer.spool.pending():
            self._pending.clear()


def _reason(value: bytes | str) -> str:
    try:
        return str(json.loads(value)["reason"])
    except (ValueError, KeyError, TypeError):
        return "quarantined (unreadable record)"
