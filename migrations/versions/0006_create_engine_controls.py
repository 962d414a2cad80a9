"""Create engine controls: admin quarantine and the explicit allow-unsafe override, by name.

Revision ID: 0006_create_engine_controls
Revises: 0005_create_engines
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_create_engine_controls"
down_revision = "0005_create_engines"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "engine_controls",
        sa.Column("engine_name", sa.String(64), nullable=False),
        sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("quarantine_reason", sa.String(256), nullable=True),
        sa.Column("allow_unsafe", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("engine_name", name="pk_engine_controls"),
    )


def downgrade() -> None:
    op.drop_table("engine_controls")
