"""Alembic environment: a connection, and the tables' metadata when a comparison needs it.

The engine comes from ``config.attributes["engine"]`` (kvguard's code path: the gateway migrating
at start, ``kvguard admin migrate``) or from ``-x url=...`` (the Alembic CLI). Batch mode lets
SQLite run the ALTERs it lacks.

Upgrades and downgrades run the revisions alone; only the Alembic CLI (``revision
--autogenerate``, ``check``) compares against the tables, so only it imports them -- the gateway's
and the canary's, both on ``contracts.sql.Base``. A gateway that migrates at start loads no canary
code through here.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine, MetaData, create_engine


def _tables() -> MetaData:
    import canary.findings  # noqa: F401  (registers the canary's tables)
    import gateway.db.models  # noqa: F401  (registers the gateway's tables)
    from contracts.sql import Base

    return Base.metadata


target_metadata = None if "engine" in context.config.attributes else _tables()


def _engine() -> Engine:
    engine = context.config.attributes.get("engine")
    if isinstance(engine, Engine):
        return engine
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("pass the database with -x url=<sqlalchemy url>")
    return create_engine(url)


def run_migrations_online() -> None:
    with _engine().connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) mode is not supported; run against a database")
run_migrations_online()
