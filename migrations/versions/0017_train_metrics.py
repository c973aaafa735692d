"""Published versions keep what the trainer reported of the step that trained them
(`param_versions.train_metrics`: its loss and metrics, as sent with the publish), so an export
of the run carries each step's logged loss for `staleflow replay`. Existing versions: none.

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("param_versions", sa.Column("train_metrics", postgresql.JSONB()))


def downgrade() -> None:
    op.drop_column("param_versions", "train_metrics")
