"""The audit's lineage checks: a group trained once, segments from the route (attempt and
instance) they belong to, segment counters, and a group version never above a live member's.

`staleness_violations` becomes audit_v2's view (renamed `staleness_violations_v2`, unchanged)
plus `lineage_violations`, both from the frozen `staleflow_db/sql/audit_lineage_v1.sql`; same name and
columns, so every reader gets the new rows. The partial index finds a group's Occupy in the
event log by group: the consume checks it before handing a batch out, and the audit reads a
run's Occupy events through it.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

AUDIT_SQL = "audit_lineage_v1.sql"  # frozen: what 0007 created, whatever audit.sql says later


def _statements(name: str) -> list[str]:
    """The statements of a package SQL file, in order: each follows its `-- name:` line."""
    import re
    from importlib.resources import files

    sql = (files("staleflow_db") / "sql" / name).read_text(encoding="utf-8")
    parts = re.split(r"^-- name: \w+[ \t]*$", sql, flags=re.MULTILINE)
    return [p.strip() for p in parts[1:]]


def upgrade() -> None:
    op.create_index(
        "ix_events_group_occupied",
        "events",
        ["run_id", "group_id"],
        postgresql_where="kind = 'group_occupied'",
    )
    op.execute("ALTER VIEW staleness_violations RENAME TO staleness_violations_v2")
    for statement in _statements(AUDIT_SQL):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP VIEW staleness_violations")
    op.execute("DROP VIEW lineage_violations")
    op.execute("ALTER VIEW staleness_violations_v2 RENAME TO staleness_violations")
    op.drop_index("ix_events_group_occupied", table_name="events")
