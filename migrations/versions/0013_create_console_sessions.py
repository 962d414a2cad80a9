"""Create console sessions: the operator console's sign-ins, shared by every gateway replica.

Revision ID: 0013_create_console_sessions
Revises: 0012_stored_responses
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_create_console_sessions"
down_revision = "0012_stored_responses"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("binding", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("token_hash", name="pk_console_sessions"),
    )
    op.create_index("ix_console_sessions_expires_at", "console_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_console_sessions_expires_at", table_name="console_sessions")
    op.drop_table("console_sessions")
