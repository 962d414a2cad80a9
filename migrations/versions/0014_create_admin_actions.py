"""Create admin actions: every operator action of the admin API and the console, with its reason.

Revision ID: 0014_create_admin_actions
Revises: 0013_create_console_sessions
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_create_admin_actions"
down_revision = "0013_create_console_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "admin_actions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("channel", sa.String(16), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target", sa.String(128), nullable=False),
        sa.Column("detail", sa.String(256), nullable=True),
        sa.Column("reason", sa.String(256), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_admin_actions"),
    )
    op.create_index("ix_admin_actions_at", "admin_actions", ["at"])


def downgrade() -> None:
    op.drop_index("ix_admin_actions_at", table_name="admin_actions")
    op.drop_table("admin_actions")
