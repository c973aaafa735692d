"""Multi-turn trajectories: a segment is a generated turn or an environment observation.

`segments.generated` (true for every existing segment) is the loss mask of its tokens: an
observation (false) was appended by the environment, carries no model version (`version` is
NULL exactly then: CHECK `observation_unversioned`) and log-prob 0 per token, and is never
trained on. The named DDL applies again: the lineage check reads the last *generated*
segment's version, and `turn_violations` (per-turn checks) joins `staleness_violations`.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

AUDIT_VIEWS = "audit_views_v1.sql"  # frozen: the audit views before this migration
AUDIT_VIEWS_AFTER = "audit_views_v2.sql"  # frozen: the audit views as this migration applies them


def _apply(frozen_views: str | None) -> None:
    from staleflow_db import queries

    for statement in queries.ddl_statements(frozen_views):
        op.execute(sa.text(statement))


def upgrade() -> None:
    op.add_column("segments", sa.Column("generated", sa.Boolean, nullable=False, server_default=sa.text("true")))
    op.alter_column("segments", "version", nullable=True)
    op.create_check_constraint(
        op.f("ck_segments_observation_unversioned"), "segments", "generated = (version IS NOT NULL)"
    )
    _apply(AUDIT_VIEWS_AFTER)


def downgrade() -> None:
    """Refused while an observation segment exists (its version cannot be made up)."""
    _apply(AUDIT_VIEWS)
    op.execute("DROP VIEW turn_violations")
    op.drop_constraint(op.f("ck_segments_observation_unversioned"), "segments", type_="check")
    op.alter_column("segments", "version", nullable=False)
    op.drop_column("segments", "generated")
