"""`ix_samples_running` keyed by (instance_id, delivered).

A poll (one instance's or a node's) and its idle check look for an instance's running samples
that are not delivered yet. Keyed by the instance alone, the index made them read every running
sample of the instance in the heap to test `delivered` (85-256 per instance at the reference
set-ups' batch sizes: ~29 buffers per instance per check for 85), while the undelivered ones are
a handful, and only between a route and its delivery. With `delivered` in the key they are found
in the index; the other users of the index (an instance's running samples) read its prefix.

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

RUNNING = sa.text("state = 'running'")


def upgrade() -> None:
    op.drop_index("ix_samples_running", table_name="samples", postgresql_where=RUNNING)
    op.create_index("ix_samples_running", "samples", ["instance_id", "delivered"], postgresql_where=RUNNING)


def downgrade() -> None:
    op.drop_index("ix_samples_running", table_name="samples", postgresql_where=RUNNING)
    op.create_index("ix_samples_running", "samples", ["instance_id"], postgresql_where=RUNNING)
