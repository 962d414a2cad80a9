"""A quarantine imposed while an engine reload, or an admin's override, reads the database
stays (PostgreSQL).

A CI run of ``kvguard demo`` met it: the canary quarantined the leaking engine, and the admin API
then showed the engine NOT quarantined. A reload (every poll interval: the overlay of quarantines
the database may not show yet, then the engines and their controls read on a worker thread, then
the registry set from what it read) had begun before the quarantine and read the database before
its row was written; setting the registry from that read lifted the quarantine on this replica
until the next reload, a poll interval later, with tenants routed to the engine meanwhile.

Here the overlap is made exact with a lock: the reload's read of ``engine_controls`` waits on it,
the quarantine is imposed (applied at once; its row waits on the lock too), then the lock goes and
both proceed. After the reload the engine must still be quarantined, in the registry and in the
admin API. The override (``allow_unsafe``) set the registry from its row in the same way: with the
row locked, the override's write waits first in line and the quarantine's row write behind it, so
the override reads a row without the quarantine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from gateway_harness import Gateway, running_gateway, until
from sqlalchemy.engine import make_url

REASON = "cross-tenant marker seen"


def _plain_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _locks_waited_on(watcher: psycopg.Connection) -> int:
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'"
    )
    row = watcher.execute(query).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture
async def gw(make_settings, standin, postgres_url) -> AsyncIterator[Gateway]:
    """The gateway on PostgreSQL, routing to one engine, ``s``."""
    settings = make_settings(
        database_url=postgres_url, engines=[{"name": "s", "base_url": standin.url}]
    )
    async with running_gateway(settings) as gateway:
        yield gateway


@contextlib.contextmanager
def locker_and_watcher(
    postgres_url: str,
) -> Iterator[tuple[psycopg.Connection, psycopg.Connection]]:
    """A connection that takes a lock in its transaction, and one that watches who waits."""
    with (
        psycopg.connect(_plain_dsn(postgres_url)) as locker,
        psycopg.connect(_plain_dsn(postgres_url), autocommit=True) as watcher,
    ):
        yield locker, watcher


async def test_a_quarantine_imposed_while_a_reload_reads_stays(
    gw: Gateway, postgres_url: str
) -> None:
    state = gw.state
    assert state.registry.get("s").controls.quarantine_reason is None
    with locker_and_watcher(postgres_url) as (locker, watcher):
        locker.execute("LOCK TABLE engine_controls IN ACCESS EXCLUSIVE MODE")
        reload = asyncio.create_task(state.reload_engines())
        await until(lambda: _locks_waited_on(watcher) == 1, "the read never reached the lock")
        imposing = asyncio.create_task(state.quarantine("s", reason=REASON))
        await until(
            lambda: state.registry.get("s").controls.quarantine_reason == REASON,
            "the quarantine was not applied at once",
        )
        locker.rollback()  # the lock goes: the reload's read and the row's write proceed
        await reload
        await imposing
    assert state.registry.get("s").controls.quarantine_reason == REASON
    r = await gw.client.get("/admin/engines", headers=gw.admin)
    assert [e["quarantine_reason"] for e in r.json() if e["name"] == "s"] == [REASON]


async def test_a_quarantine_imposed_while_an_override_writes_stays(
    gw: Gateway, postgres_url: str
) -> None:
    state, override = gw.state, "/admin/engines/s/override"
    r = await gw.client.put(override, json={"allow_unsafe": False}, headers=gw.admin)
    assert r.status_code == 200, r.text  # the engine's control row exists from here
    with locker_and_watcher(postgres_url) as (locker, watcher):
        locker.execute("SELECT 1 FROM engine_controls WHERE engine_name = 's' FOR UPDATE")
        overriding = asyncio.create_task(
            gw.client.put(override, json={"allow_unsafe": True}, headers=gw.admin)
        )
        await until(lambda: _locks_waited_on(watcher) == 1, "the override never waited")
        imposing = asyncio.create_task(state.quarantine("s", reason=REASON))
        await until(lambda: _locks_waited_on(watcher) == 2, "the row's write never waited")
        locker.rollback()  # the override's write goes first, then the quarantine's row
        r = await overriding
        await imposing
    assert r.status_code == 200, r.text
    assert r.json()["quarantine_reason"] == REASON and r.json()["allow_unsafe"] is True
    assert state.registry.get("s").controls.quarantine_reason == REASON
