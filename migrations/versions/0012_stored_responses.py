"""Stored responses: the Responses API's ``store``, kept per tenant (``gateway.db.models``).

Revision ID: 0012_stored_responses
Revises: 0011_quarantine_cleared_at
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_stored_responses"
down_revision = "0011_quarantine_cleared_at"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("conversation", sa.JSON(), nullable=False),
        sa.Column("input_start", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_stored_responses_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", "id", name="pk_stored_responses"),
    )
    op.create_index("ix_stored_responses_expires_at", "stored_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_expires_at", table_name="stored_responses")
    op.drop_table("stored_responses")
