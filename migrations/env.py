"""Alembic environment: the gateway's and the canary's table metadata and a connection.

The engine comes from ``config.attributes["engine"]`` (kvguard's code path) or from
``-x url=...`` (the Alembic CLI). Batch mode lets SQLite run the ALTERs it lacks.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine, create_engine

import canary.findings  # noqa: F401  (registers the canary's tables on the same metadata)
from gateway.db.models import Base

target_metadata = Base.metadata


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
