"""Admin-registered engines hold a group's members, a key reference and the header policy.

Members (an SGLang/vLLM deployment's workers) are a JSON list; the key is never stored, only the
name of the gateway environment variable that holds it (a secret reference).

Revision ID: 0009_engine_groups_and_key_refs
Revises: 0008_create_canary_probe_runs
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_engine_groups_and_key_refs"
down_revision = "0008_create_canary_probe_runs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("members", sa.Text(), nullable=True))
        batch.add_column(sa.Column("api_key_env", sa.String(128), nullable=True))
        batch.add_column(sa.Column("declared_pool_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("send_kvguard_headers", sa.Boolean(), nullable=True))
        batch.add_column(sa.Column("api_base", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        for column in (
            "api_base",
            "send_kvguard_headers",
            "declared_pool_tokens",
            "api_key_env",
            "members",
        ):
            batch.drop_column(column)
