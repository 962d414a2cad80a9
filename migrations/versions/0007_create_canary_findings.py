"""Create canary findings: isolation findings of the leak firewall and the lower-severity checks
(ids, kinds and numbers only, never marker text or content).

Revision ID: 0007_create_canary_findings
Revises: 0006_create_engine_controls
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_create_canary_findings"
down_revision = "0006_create_engine_controls"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "canary_findings",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("detected_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("evidence", sa.String(16), nullable=False),
        sa.Column("victim_tenant_id", sa.String(32), nullable=True),
        sa.Column("observer_tenant_id", sa.String(32), nullable=True),
        sa.Column("engine", sa.String(64), nullable=True),
        sa.Column("observer_request_id", sa.String(32), nullable=True),
        sa.Column("victim_request_id", sa.String(32), nullable=True),
        sa.Column("victim_engine", sa.String(64), nullable=True),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("detail", sa.String(256), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_canary_findings"),
    )
    op.create_index(
        "ix_canary_findings_victim_detected",
        "canary_findings",
        ["victim_tenant_id", "detected_at"],
    )
    op.create_index("ix_canary_findings_detected", "canary_findings", ["detected_at"])


def downgrade() -> None:
    op.drop_index("ix_canary_findings_detected", table_name="canary_findings")
    op.drop_index("ix_canary_findings_victim_detected", table_name="canary_findings")
    op.drop_table("canary_findings")
