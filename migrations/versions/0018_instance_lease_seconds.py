"""The instance's lease length, so any call of the instance renews its lease.

`instances.lease_s`: the seconds a renewal extends the lease by, set at registration and by
every heartbeat (both carry `lease_seconds`). A poll or a report of the instance renews the
lease by this much in its own statement (staleflow_db/sql/rollout.sql), so a busy instance
needs no separate heartbeat. Existing rows get 30 s, the heartbeat's default.

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("lease_s", sa.Double(), nullable=False, server_default=sa.text("30")))


def downgrade() -> None:
    op.drop_column("instances", "lease_s")
