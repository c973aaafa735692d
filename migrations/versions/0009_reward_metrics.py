"""Reward metrics: a sample keeps the extra metrics its reward came with.

`samples.reward_metrics` (jsonb, NULL when the reward came alone). The `reward_failed` drop
reason needs no change here: `samples.reason` and `prompt_groups.reason` are text.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("samples", sa.Column("reward_metrics", JSONB))


def downgrade() -> None:
    op.drop_column("samples", "reward_metrics")
