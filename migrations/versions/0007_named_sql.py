"""Named SQL: the views and functions as the named DDL in staleflow_db/sql/ defines them.

Every `view_*` and `function_*` named query (`staleflow_db.queries.ddl()`: the audit views,
staleflow_append_only, staleflow_lock_run, staleflow_lock_run_read,
staleflow_idempotency_lookup) is applied with CREATE OR REPLACE, so a migrated database has
exactly what the files say. The definitions equal those of migrations 0001-0006, which stay
as they were (history). A later change to one of them edits its file and adds a migration
that applies it again (`apply_named_ddl`), keeping the definition it replaces for its
downgrade, as this one takes the earlier ones from 0001-0006.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

VIEWS = ("trained_samples", "dropped_samples", "staleness_violations")


def apply_named_ddl() -> None:
    import sqlalchemy as sa

    from staleflow_db import queries

    for q in queries.ddl():
        op.execute(sa.text(q.sql))


def _migration(filename: str):
    """An earlier migration's module, for the definitions it created."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"_staleflow_{filename[:4]}", Path(__file__).with_name(filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _or_replace(ddl: str) -> str:
    return ddl.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def upgrade() -> None:
    apply_named_ddl()


def downgrade() -> None:
    """Back to the definitions of 0001-0006 (views dropped and created again: a view's
    columns cannot shrink in place)."""
    from importlib.resources import files

    initial = _migration("0001_initial.py")
    op.execute("; ".join(f"DROP VIEW {v}" for v in reversed(VIEWS)))
    views = initial.AUDIT_VIEWS
    op.execute(views[: views.index("CREATE VIEW staleness_violations")])
    op.execute(
        (files("staleflow_db") / "sql" / _migration("0002_reliability.py").AUDIT_SQL).read_text(encoding="utf-8")
    )
    append_only = initial.APPEND_ONLY
    op.execute(_or_replace(append_only[: append_only.index("CREATE TRIGGER")]))
    op.execute(_or_replace(_migration("0004_lock_run.py").LOCK_RUN))
    op.execute(_or_replace(_migration("0005_lock_run_read.py").LOCK_RUN_READ))
    op.execute(_or_replace(_migration("0006_idempotency_lookup.py").LOOKUP))
