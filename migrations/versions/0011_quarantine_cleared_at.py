"""Engine controls remember when a quarantine was last lifted (quarantine_cleared_at).

A quarantine spooled while PostgreSQL was unreachable is written late; one decided before the
last clear must not come back (``gateway.services.quarantine``).

Revision ID: 0011_quarantine_cleared_at
Revises: 0010_engine_member_discovery
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_quarantine_cleared_at"
down_revision = "0010_engine_member_discovery"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engine_controls") as batch:
        batch.add_column(sa.Column("quarantine_cleared_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    with op.batch_alter_table("engine_controls") as batch:
        batch.drop_column("quarantine_cleared_at")
