"""The coordinator's snapshot as changes: a log of the in-flight samples and groups each
transaction changed, so a cycle reads what changed since its last read, not the whole run.

`snapshot_changes`: one row per statement that inserted or updated samples (ids of those queued
or running before or after it) or changed a group's state, reserved buffer or least member
version (the queued rows' group fields), written by statement-level triggers (transition
tables: one row per statement, not per sample) with the writer's transaction id (`xid`, an
xid8 as bigint). A reader at snapshot S asks next for the rows with `xid >= xmax(S)` or `xid`
in S's in-progress list: every transaction S did not see is one of those, so nothing is missed
(rows seen twice are harmless: a change carries the row's current state). `snapshot_horizons`:
per run, the least xid a read may still start from (rows below it were pruned: older readers
get the whole snapshot).

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

IN_FLIGHT = "('queued', 'running')"

FUNCTIONS = f"""
CREATE FUNCTION staleflow_samples_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO snapshot_changes (run_id, sample_ids)
  SELECT n.run_id, array_agg(n.id) FROM new_rows n WHERE n.state IN {IN_FLIGHT} GROUP BY n.run_id;
  RETURN NULL;
END $$;

CREATE FUNCTION staleflow_samples_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO snapshot_changes (run_id, sample_ids)
  SELECT n.run_id, array_agg(n.id) FROM new_rows n JOIN old_rows o ON o.id = n.id
  WHERE n.state IN {IN_FLIGHT} OR o.state IN {IN_FLIGHT} GROUP BY n.run_id;
  RETURN NULL;
END $$;

CREATE FUNCTION staleflow_groups_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO snapshot_changes (run_id, group_ids)
  SELECT n.run_id, array_agg(n.id) FROM new_rows n JOIN old_rows o ON o.id = n.id
  WHERE (n.state, n.reserved_buffer, n.min_version) IS DISTINCT FROM (o.state, o.reserved_buffer, o.min_version)
  GROUP BY n.run_id;
  RETURN NULL;
END $$;

CREATE TRIGGER samples_inserted_changes AFTER INSERT ON samples REFERENCING NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION staleflow_samples_inserted();
CREATE TRIGGER samples_updated_changes AFTER UPDATE ON samples REFERENCING OLD TABLE AS old_rows
  NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION staleflow_samples_updated();
CREATE TRIGGER groups_updated_changes AFTER UPDATE ON prompt_groups REFERENCING OLD TABLE AS old_rows
  NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION staleflow_groups_updated();
"""

DROP = """
DROP TRIGGER groups_updated_changes ON prompt_groups;
DROP TRIGGER samples_updated_changes ON samples;
DROP TRIGGER samples_inserted_changes ON samples;
DROP FUNCTION staleflow_groups_updated();
DROP FUNCTION staleflow_samples_updated();
DROP FUNCTION staleflow_samples_inserted();
"""


def upgrade() -> None:
    op.create_table(
        "snapshot_changes",
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column(
            "xid",
            sa.BigInteger(),
            server_default=sa.text("CAST(CAST(pg_current_xact_id() AS text) AS bigint)"),
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("sample_ids", sa.ARRAY(sa.BigInteger())),
        sa.Column("group_ids", sa.ARRAY(sa.BigInteger())),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_snapshot_changes_run_id", ondelete="CASCADE"),
    )
    op.create_index("ix_snapshot_changes_run_id_xid", "snapshot_changes", ["run_id", "xid"], unique=False)
    op.create_table(
        "snapshot_horizons",
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("pruned_below", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_snapshot_horizons_run_id", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", name="pk_snapshot_horizons"),
    )
    op.execute(FUNCTIONS)


def downgrade() -> None:
    op.execute(DROP)
    op.drop_table("snapshot_horizons")
    op.drop_index("ix_snapshot_changes_run_id_xid", table_name="snapshot_changes")
    op.drop_table("snapshot_changes")
