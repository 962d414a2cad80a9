"""The metadata base every kvguard SQL table is declared on, the column types they share, and the
unit of work every deployable runs its statements in.

The gateway's tables (``gateway.db.models``) and the canary's (``canary.findings``) live on this one
``Base``, so one Alembic history (``migrations/``) covers them all, without either deployable
importing the other's tables. A unit of work (``session_scope``) commits on success and rolls back
on any exception; ``run_in_session`` runs one on a worker thread, bounded by the session factory's
``timeout_s`` (``make_session_factory``; engines and migrations: ``gateway.db.session``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
import psycopg
from sqlalchemy import BigInteger, DateTime, Engine, Integer, MetaData, TypeDecorator
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

T = TypeVar("T")
_TIMEOUT = "kvguard_timeout_s"  # where a session factory keeps its bound

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# 64-bit ids on PostgreSQL; SQLite autoincrements only an INTEGER primary key.
AUDIT_ID = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on the Python side on every backend (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class DatabaseTimeout(PoolTimeout):
    """The database did not answer within the bound (a pool timeout to every handler)."""


DATABASE_ERRORS = (DBAPIError, PoolTimeout, psycopg.Error)
"""What a call into the database can raise about the database (``is_outage`` tells which); the
driver's own errors come from a connection used without SQLAlchemy (``gateway.db.link``)."""


def is_outage(exc: BaseException) -> bool:
    """The database could not be reached (retry later: a 503 to a client, the same rows again for
    a writer), as opposed to a refusal of something in the statement: refused, reset or closed
    connections (the driver's operational and interface errors, a connection invalidated under
    the call), an exhausted pool, a call past its bound."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeout | OSError | TimeoutError):
        return True
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return True  # the driver's own, on a connection used without SQLAlchemy (gateway.db.link)
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def make_session_factory(
    engine: Engine, *, timeout_s: float | None = None
) -> sessionmaker[Session]:
    """Sessions on ``engine``; ``timeout_s`` bounds each ``run_in_session`` with them."""
    return sessionmaker(engine, expire_on_commit=False, info={_TIMEOUT: timeout_s})


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any exception."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


async def run_in_session(factory: sessionmaker[Session], work: Callable[[Session], T]) -> T:
    """Run ``work`` in one unit of work on a worker thread (the event loop never blocks on SQL);
    with the factory's ``timeout_s``, raise ``DatabaseTimeout`` once that has passed (the thread
    itself is released by the watchdog)."""

    def run() -> T:
        with session_scope(factory) as session:
            return work(session)

    timeout_s = factory.kw.get("info", {}).get(_TIMEOUT)
    if timeout_s is None:
        return await anyio.to_thread.run_sync(run)
    with anyio.move_on_after(timeout_s) as scope:
        return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    assert scope.cancelled_caught
    raise DatabaseTimeout(f"the database did not answer within {timeout_s:.1f} s")
