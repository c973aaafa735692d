"""Lineage: who scored each reward, and the `trained_lineage` view.

`samples.reward_token_id` (the API token that posted the reward, NULL when recorded in-process;
SET NULL if the token row goes) names the scorer. The named DDL applies again: `trained_lineage`
(audit.sql) is one row per segment of each trained sample with its model version, instance,
that version's published checksum and location, and the reward with its metrics and scorer.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

AUDIT_VIEWS = "audit_views_v2.sql"  # frozen: the audit views before this migration
AUDIT_VIEWS_AFTER = "audit_views_v3.sql"  # frozen: the audit views as this migration applies them


def _apply(frozen_views: str) -> None:
    from staleflow_db import queries

    for statement in queries.ddl_statements(frozen_views):
        op.execute(sa.text(statement))


def upgrade() -> None:
    op.add_column("samples", sa.Column("reward_token_id", sa.BigInteger()))
    op.create_foreign_key(
        op.f("fk_samples_reward_token_id"),
        "samples",
        "api_tokens",
        ["reward_token_id"],
        ["id"],
        ondelete="SET NULL",
    )
    _apply(AUDIT_VIEWS_AFTER)


def downgrade() -> None:
    op.execute("DROP VIEW trained_lineage")
    _apply(AUDIT_VIEWS)
    op.drop_constraint(op.f("fk_samples_reward_token_id"), "samples", type_="foreignkey")
    op.drop_column("samples", "reward_token_id")
