"""Many rows into one table with PostgreSQL's ``COPY ... FROM STDIN``, bounded like any statement.

Why: a multi-row INSERT through SQLAlchemy handles every value in Python (a bind parameter, its
type's processing, the statement's text), and the audit writer's flush holds the GIL meanwhile,
so every request in flight waits for it. COPY sends the rows in psycopg's row format, built in C:
a batch of 64 audit rows took 0.39x the INSERT's CPU, 250 rows 0.27x
(``python -m bench.bench_audit_flush``: 1.91 -> 0.74 ms and 5.66 -> 1.52 ms).

The COPY runs on the session's own connection, inside its transaction (the session's commit or
rollback ends it), but on the driver's cursor, below SQLAlchemy's statement events. So it does
itself what those events do for a statement:

- it arms the engine's watchdog (``gateway.db.watchdog.of``) for its whole length: a frozen
  server is cut within the same bound as any statement's;
- a driver error becomes SQLAlchemy's (``DBAPIError.instance``: an ``OperationalError`` for a
  broken connection, a ``DataError`` for a value the column refuses), so callers tell an outage
  from a refusal with ``contracts.sql.is_outage`` as for any statement;
- a connection that broke is invalidated: the pool discards it instead of lending it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Connection, Table
from sqlalchemy.exc import DBAPIError

from gateway.db import watchdog


def copy_statement(table: Table, columns: Sequence[str]) -> sql.Composed:
    """``COPY table (columns) FROM STDIN``, every name quoted."""
    return sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(table.name), sql.SQL(", ").join(map(sql.Identifier, columns))
    )


def copy_rows(
    connection: Connection, table: Table, columns: Sequence[str], rows: Iterable[Sequence[Any]]
) -> None:
    """Write ``rows`` (values in the order of ``columns``) into ``table`` with one COPY."""
    statement = copy_statement(table, columns)
    raw = connection.connection.dbapi_connection
    assert isinstance(raw, psycopg.Connection), "COPY needs the psycopg driver"
    bound = watchdog.of(connection.engine)
    if bound is not None:
        bound.arm(raw)
    try:
        with raw.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)
    except psycopg.Error as exc:
        broken = raw.closed or connection.dialect.is_disconnect(exc, raw, None)
        if broken:
            connection.invalidate(exc)
        raise DBAPIError.instance(
            statement.as_string(raw),
            None,
            exc,
            psycopg.Error,
            connection_invalidated=broken,
            dialect=connection.dialect,
        ) from exc
    finally:
        if bound is not None:
            bound.disarm(raw)
