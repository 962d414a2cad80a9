"""Database engines, sessions and programmatic Alembic upgrades.

The gateway uses synchronous SQLAlchemy: the hot path runs its few short statements in a worker
thread, admin routes are plain ``def`` routes (FastAPI runs them in its threadpool). SQLite gets
WAL, a busy timeout and enforced foreign keys so several processes can share the embedded file.
On PostgreSQL, upgrades hold an advisory lock: replicas starting together migrate once.

Bounded time (``timeout_s``, the gateway's ``database_timeout_s``): on PostgreSQL every connect,
pool checkout and round trip is bounded (``gateway.db.watchdog``), and ``run_in_session`` gives up
waiting for its worker thread after the same time (``DatabaseTimeout``, which the app answers as
its 503 ``database_unavailable``), so a frozen database never holds a request, ``/health`` or a
background loop for longer. Migrations run on an engine of their own, without the bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url

import migrations
from gateway.db import watchdog

# __path__, not __file__: an editable install made before migrations/__init__.py existed maps
# the directory as a namespace package (no __file__); both forms have a __path__.
MIGRATIONS_DIR = Path(next(iter(migrations.__path__))).resolve()
# Any constant works; it only has to be the same in every replica.
_ADVISORY_LOCK_KEY = 0x6B76_6775_6172_64


def make_engine(url: str, *, timeout_s: float | None = None, **kwargs: Any) -> Engine:
    """An engine for ``url``; with ``timeout_s`` every PostgreSQL operation is bounded by it."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False}, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if timeout_s is None:
        return create_engine(url, pool_pre_ping=True, **kwargs)
    connect_args = {"connect_timeout": max(2, math.ceil(timeout_s))}  # libpq: whole s, >= 2
    engine = create_engine(url, pool_timeout=timeout_s, connect_args=connect_args, **kwargs)
    watchdog.install(engine, timeout_s)  # its checkout ping replaces pool_pre_ping
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def alembic_config(engine: Engine) -> Config:
    """Alembic config without an ini file on disk (env.py reads the connection we pass)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    return config


def upgrade_database(engine: Engine, revision: str = "head") -> None:
    with _migration_lock(engine):
        command.upgrade(alembic_config(engine), revision)


def downgrade_database(engine: Engine, revision: str) -> None:
    with _migration_lock(engine):
        command.downgrade(alembic_config(engine), revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    if engine.dialect.name != "postgresql":
        yield  # SQLite serialises writers itself
        return
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _ADVISORY_LOCK_KEY})
        conn.commit()
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _ADVISORY_LOCK_KEY})
            conn.commit()
