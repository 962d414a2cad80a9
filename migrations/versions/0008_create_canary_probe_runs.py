"""Create canary probe runs: one row per probe result (kind, engine, expected, observed, pass).

Revision ID: 0008_create_canary_probe_runs
Revises: 0007_create_canary_findings
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_create_canary_probe_runs"
down_revision = "0007_create_canary_findings"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "canary_probe_runs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("engine", sa.String(64), nullable=True),
        sa.Column("expected", sa.String(256), nullable=False),
        sa.Column("observed", sa.String(256), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_canary_probe_runs"),
    )
    op.create_index("ix_canary_probe_runs_run_id", "canary_probe_runs", ["run_id"])
    op.create_index(
        "ix_canary_probe_runs_kind_started", "canary_probe_runs", ["kind", "started_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_canary_probe_runs_kind_started", table_name="canary_probe_runs")
    op.drop_index("ix_canary_probe_runs_run_id", table_name="canary_probe_runs")
    op.drop_table("canary_probe_runs")
