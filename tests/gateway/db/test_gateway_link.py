"""A background loop's own PostgreSQL connection (``gateway.db.link.Link``) on a real PostgreSQL
behind a link that can freeze (every byte held, the server's kernel still acknowledging) or be
cut (every connection reset, new ones refused)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

from bench.fault_stack import TcpLink
from contracts.sql import DatabaseTimeout
from gateway.db.link import Link
from gateway.db.session import make_engine

BOUND_S = 1.0


@pytest.fixture
async def linked(postgres_url: str) -> AsyncIterator[tuple[Link, TcpLink]]:
    url = make_url(postgres_url)
    assert url.host is not None and url.port is not None
    tcp = TcpLink(url.host, url.port)
    engine = make_engine(url.set(port=tcp.port).render_as_string(hide_password=False))
    link = Link.of(engine, timeout_s=BOUND_S)
    assert link is not None
    try:
        yield link, tcp
    finally:
        tcp.close()
        await link.close()
        engine.dispose()


async def test_a_statement_on_a_frozen_server_is_cut_at_the_bound_and_the_next_connects_anew(
    linked: tuple[Link, TcpLink],
) -> None:
    """The statement waits no longer than the bound: its socket is cut (a timer on the event
    loop), it raises ``DatabaseTimeout``, and once the server answers again the next statement
    runs on a new connection (the cut one was dropped), in UTC like the first."""
    link, tcp = linked
    assert [tuple(r) for r in await link.rows("SELECT 1 AS one")] == [(1,)]
    tcp.freeze()
    started = time.monotonic()
    with pytest.raises(DatabaseTimeout):
        await link.rows("SELECT 2")
    waited = time.monotonic() - started
    assert BOUND_S <= waited < BOUND_S + 1, waited
    tcp.thaw()
    assert [tuple(r) for r in await link.rows("SHOW TIME ZONE")] == [("UTC",)]


async def test_a_refused_statement_keeps_the_connection_and_a_reset_one_is_replaced(
    linked: tuple[Link, TcpLink],
) -> None:
    """A statement the database refuses raises the database's error (not a timeout) on a
    connection that stays (the same server process answers next); a connection reset under a
    statement raises psycopg's operational error and is dropped: the next statement, once the
    server is reachable again, runs on a new one."""
    link, tcp = linked
    [(pid,)] = await link.rows("SELECT pg_backend_pid()")
    with pytest.raises(psycopg.errors.UndefinedTable):
        await link.rows("SELECT * FROM no_such_table")
    assert [tuple(r) for r in await link.rows("SELECT pg_backend_pid()")] == [(pid,)]
    tcp.cut()
    with pytest.raises(psycopg.OperationalError):
        await link.rows("SELECT 1")
    tcp.restore()
    [(again,)] = await link.rows("SELECT pg_backend_pid()")
    assert again != pid


async def test_a_statement_given_up_on_a_frozen_server_ends_at_once_and_the_next_runs(
    linked: tuple[Link, TcpLink],
) -> None:
    """A caller that gives up on a statement (its own bound, a client gone) while the server does
    not answer gets its cancellation at once, not after psycopg's attempt to cancel the query on
    that server (5 s), and the link's next statement, once the server answers, runs on a new
    connection instead of failing on the one psycopg closed under the link."""
    link, tcp = linked
    [(pid,)] = await link.rows("SELECT pg_backend_pid()")
    tcp.freeze()
    given_up = asyncio.ensure_future(link.rows("SELECT 'late'"))
    done, _ = await asyncio.wait([given_up], timeout=0.1)  # sent; the server holds it
    assert not done
    given_up.cancel()
    done, _ = await asyncio.wait([given_up], timeout=BOUND_S / 2)  # well before the cut's timer
    assert done and given_up.cancelled()
    tcp.thaw()
    [(again, word)] = await link.rows("SELECT pg_backend_pid(), 'mine'")
    assert (word, again != pid) == ("mine", True)


async def test_a_read_on_a_connection_reset_while_idle_runs_again_on_a_new_one(
    linked: tuple[Link, TcpLink],
) -> None:
    """A link's connection reset while it sat idle (the database restarted, the network reset
    it) is found broken only by the next statement: a read (``rows``) then runs once more on a
    new connection instead of failing, while the database is reachable; while it is not, the read
    fails with the driver's error."""
    link, tcp = linked
    [(pid,)] = await link.rows("SELECT pg_backend_pid()")
    tcp.cut()
    with pytest.raises(psycopg.OperationalError):
        await link.rows("SELECT 1")  # the old connection broken, a new one refused
    tcp.restore()
    [(again,)] = await link.rows("SELECT pg_backend_pid()")
    tcp.cut()
    tcp.restore()  # reset while idle; the database reachable again
    [(third,)] = await link.rows("SELECT pg_backend_pid()")
    assert len({pid, again, third}) == 3
