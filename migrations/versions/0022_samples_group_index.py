"""Samples lose `ix_samples_group`: the unique index on (group_id, idx) serves every lookup by group.

`uq_samples_group_id_idx` leads with `group_id`, so it answers `group_id = X` and
`group_id = ANY(...)` as the single-column index did (the plan guards in
`tests/db/test_locked_reads.py` check the locked reads). Every state change of a sample is a
non-HOT update (`state` is in the partial indexes' predicates), and a non-HOT update inserts
into every index of the table: the redundant one cost one index insert and one WAL record per
sample transition (`bench/protocol.py`, docs/benchmarks.md).

Revision ID: 0022
Revises: 0021
"""

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_samples_group", table_name="samples")


def downgrade() -> None:
    op.create_index("ix_samples_group", "samples", ["group_id"], unique=False)
