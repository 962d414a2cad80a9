"""Create the request audit table (metadata only, never prompt or completion text).

Revision ID: 0003_create_request_audit
Revises: 0002_create_api_keys
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_create_request_audit"
down_revision = "0002_create_api_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "request_audit",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("request_id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_prefix", sa.String(16), nullable=True),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("engine", sa.String(64), nullable=True),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("max_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("handoff_outcome", sa.String(32), nullable=True),
        sa.Column("reserved_tokens", sa.Integer(), nullable=True),
        sa.Column("transferred_tokens", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_request_audit"),
    )
    op.create_index("ix_request_audit_request_id", "request_audit", ["request_id"])
    op.create_index("ix_request_audit_tenant_started", "request_audit", ["tenant_id", "started_at"])


def downgrade() -> None:
    op.drop_index("ix_request_audit_tenant_started", table_name="request_audit")
    op.drop_index("ix_request_audit_request_id", table_name="request_audit")
    op.drop_table("request_audit")
