"""A PostgreSQL connection of the gateway's own, on the event loop: ``Link``.

Why: two loops of every replica write or read the database whatever its load: the key renewal
(``gateway.deps.renew_verified_keys``: the keys in use, every half ``auth_cache_ttl_s``) and the
audit writer's flush (``gateway.services.audit``: every ``audit_flush_interval_s``). Through a
pooled SQLAlchemy session on a worker thread, a renewal cost the replica about 4.5 ms of CPU and a
flush of a few rows about 3 ms: the watchdog's checkout ping, BEGIN, the statements, COMMIT,
SQLAlchemy's execution of each, and the worker thread's hand-offs of the GIL with the event loop,
on the core the data plane runs on. A link runs them on psycopg's ``AsyncConnection``: a read in
autocommit is one round trip, with no pool and no thread (about 1 ms; ``docs/benchmarks.md``,
issue 33's step 14). The request path's key lookups run on links too
(``gateway.services.keys.LookupLinks``): with many tenants most requests are one (step 16).

Bounded like every database operation of the gateway (``gateway.db.watchdog``): connecting by
libpq's ``connect_timeout`` (whole seconds, at least 2), a statement by a timer on the event loop
that cuts the connection's socket once ``timeout_s`` has passed. Cancelling the wait instead would
leave psycopg trying to cancel the query on a server that does not answer: a frozen server keeps
its socket open, and only a cut ends the wait at once. A caller that gives up on a statement
(cancels it) gets the same: the statement's socket is cut and its connection dropped at once, not
left to psycopg's own answer to a cancellation (a cancel request to the server, waited for up to
5 s, and the connection closed under the link). A cut or broken connection is dropped; the next
statement connects anew, and a read (``rows``) that found its connection broken (reset while it sat
idle) runs once more on a new one. Statements run one at a time.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import Engine

from contracts.sql import DatabaseTimeout
from gateway.db import watchdog

T = TypeVar("T")
Work = Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]


class Link:
    """One autocommit connection for one loop's or lane's work: a statement's ``rows``, or
    several statements in one ``transaction``; connected on first use (libpq's
    ``connect_timeout`` bounds the connect, the loop's timer every use after it)."""

    def __init__(self, conninfo: str, *, timeout_s: float) -> None:
        self._conninfo = conninfo
        self._timeout_s = timeout_s
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._turn = asyncio.Lock()

    @classmethod
    def of(cls, engine: Engine, *, timeout_s: float) -> Link | None:
        """A link to the database of ``engine`` (the gateway's); None unless it is PostgreSQL."""
        if engine.dialect.name != "postgresql":
            return None
        url = engine.url.set(drivername="postgresql")
        return cls(url.render_as_string(hide_password=False), timeout_s=timeout_s)

    async def rows(self, query: str, params: Mapping[str, Any] | None = None) -> list[Any]:
        """The rows of ``query`` (named tuples; times in UTC, as ``contracts.sql.UTCDateTime``
        reads them); raises ``DatabaseTimeout`` when the statement was cut at the bound, and
        psycopg's error when the database refused it or could not be reached. ``query`` only
        reads: on a connection that broke while it sat idle (the database restarted, the network
        reset it) it runs once more, on a new one."""

        async def fetch(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            cursor = await conn.execute(query, params)
            return await cursor.fetchall() if cursor.description is not None else []

        return await self.run(fetch, reads_only=True)

    async def transaction(self, work: Work[T]) -> T:
        """``work`` in one transaction (committed when it returns, rolled back when it raises),
        bounded as a whole like one statement."""

        async def inside(conn: psycopg.AsyncConnection[Any]) -> T:
            async with conn.transaction():
                return await work(conn)

        return await self.run(inside)

    async def run(self, work: Work[T], *, reads_only: bool = False) -> T:
        """``work`` on the connection (autocommit), alone on it, bounded by ``timeout_s``;
        ``reads_only``: ``work`` changes nothing, so it may run again (``rows``)."""
        async with self._turn:
            conn = self._conn
            if conn is None:
                return await self._bounded(await self._connect(), work)
            try:
                return await self._bounded(conn, work)
            except psycopg.OperationalError:
                if not reads_only or self._conn is not None:
                    raise  # a write may have landed; a connection that stays did not break
                # it broke while idle (or under this read): the read again, on a new connection
                return await self._bounded(await self._connect(), work)

    async def connect(self) -> None:
        """Connect now (if not connected), so that the first statement does not wait for it."""
        async with self._turn:
            if self._conn is None:
                await self._connect()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(
            self._conninfo,
            autocommit=True,
            row_factory=namedtuple_row,
            connect_timeout=max(2, math.ceil(self._timeout_s)),
        )
        try:
            await self._bounded(conn, _utc)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        return conn

    async def _bounded(self, conn: psycopg.AsyncConnection[Any], work: Work[T]) -> T:
        cuts: list[bool] = []
        timer = asyncio.get_running_loop().call_later(
            self._timeout_s, lambda: cuts.append(watchdog.cut(conn))
        )
        under_way = asyncio.ensure_future(work(conn))
        try:
            # shielded: psycopg answers a cancellation by cancelling the query on the server and
            # waiting for it (up to 5 s each, on a server that does not answer), then closes the
            # connection under the link
            return await asyncio.shield(under_way)
        except asyncio.CancelledError:
            # The caller gave up (its own bound, a client gone, shutdown): the statement may still
            # be running, so its connection goes, cut first so the work ends at once.
            self._conn = None  # first: a second cancellation below leaves it dropped too
            if not under_way.done():
                watchdog.cut(conn)
                await asyncio.wait([under_way])
            if not under_way.cancelled():
                under_way.exception()  # read: nobody else will, and asyncio would report it
            await conn.close()
            raise
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                await self._drop()  # the next statement connects anew
            if cuts:
                raise DatabaseTimeout(
                    f"the database did not answer within {self._timeout_s:.1f} s"
                ) from exc
            raise
        finally:
            timer.cancel()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def close(self) -> None:
        async with self._turn:
            await self._drop()


async def _utc(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("SET TIME ZONE 'UTC'")  # times as ``contracts.sql.UTCDateTime`` reads them
