"""Alembic migrations: upgrade -> downgrade -> upgrade on SQLite and PostgreSQL, and no drift
between the models and the migrated schema."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

import canary.findings  # noqa: F401  (the canary's tables, on the shared metadata)
import gateway.db.models  # noqa: F401  (the gateway's tables, on the shared metadata)
from contracts.sql import Base
from gateway.db.session import current_revision, downgrade_database, make_engine, upgrade_database

GATEWAY_TABLES = {
    "tenants",
    "api_keys",
    "request_audit",
    "engines",
    "engine_controls",
    "stored_responses",
}
GATEWAY_TABLES |= {"console_sessions", "admin_actions"}
CANARY_TABLES = {"canary_findings", "canary_probe_runs"}
ALL_TABLES = GATEWAY_TABLES | CANARY_TABLES


@pytest.fixture(params=["sqlite_url", "postgres_url"])
def db_engine(request: pytest.FixtureRequest):
    engine = make_engine(request.getfixturevalue(request.param))
    yield engine
    engine.dispose()


def _tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_downgrade_upgrade(db_engine) -> None:
    upgrade_database(db_engine)
    assert _tables(db_engine) == ALL_TABLES
    assert current_revision(db_engine) == "0014_create_admin_actions"

    downgrade_database(db_engine, "base")
    assert _tables(db_engine) == set()
    assert current_revision(db_engine) is None

    upgrade_database(db_engine)
    assert _tables(db_engine) == ALL_TABLES


def test_models_match_migrated_schema(db_engine) -> None:
    upgrade_database(db_engine)
    with db_engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        diffs = compare_metadata(context, Base.metadata)
    assert diffs == []


def test_canary_fields_fill_existing_tenants(db_engine) -> None:
    upgrade_database(db_engine, "0003_create_request_audit")
    with db_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tenants (id, name, status, created_at, updated_at) "
                "VALUES ('tn_old', 'old', 'active', :now, :now)"
            ),
            {"now": "2026-01-01 00:00:00"},
        )
    upgrade_database(db_engine)
    with db_engine.connect() as conn:
        row = conn.execute(text("SELECT canary_sample_rate, synthetic FROM tenants")).one()
    assert (row[0], bool(row[1])) == (0.0, False)
