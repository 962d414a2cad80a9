"""Admin-registered engines may read their members from the router (discover_members).

Revision ID: 0010_engine_member_discovery
Revises: 0009_engine_groups_and_key_refs
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_engine_member_discovery"
down_revision = "0009_engine_groups_and_key_refs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("discover_members", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.drop_column("discover_members")
