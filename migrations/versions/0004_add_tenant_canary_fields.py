"""Add the canary's per-tenant fields: sample rate and the synthetic (probe tenant) flag.

Revision ID: 0004_add_tenant_canary_fields
Revises: 0003_create_request_audit
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_add_tenant_canary_fields"
down_revision = "0003_create_request_audit"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(
            sa.Column("canary_sample_rate", sa.Float(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("synthetic", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    # The server defaults only fill existing rows; the application always sets both.
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column("canary_sample_rate", server_default=None)
        batch.alter_column("synthetic", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("synthetic")
        batch.drop_column("canary_sample_rate")
