"""Create the table of engines registered through the admin API.

Revision ID: 0005_create_engines
Revises: 0004_add_tenant_canary_fields
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_create_engines"
down_revision = "0004_add_tenant_canary_fields"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "engines",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("base_url", sa.String(512), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("litellm_model", sa.String(256), nullable=True),
        sa.Column("declared_max_model_len", sa.Integer(), nullable=True),
        sa.Column("allow_unverified", sa.Boolean(), nullable=False),
        sa.Column("upstream", sa.String(16), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_engines"),
    )


def downgrade() -> None:
    op.drop_table("engines")
