"""Named SQL: the views and functions as the named DDL in staleflow_db/sql/ defines them.

Every `view_*` and `function_*` named query (`staleflow_db.queries.ddl()`: the audit views,
staleflow_append_only, staleflow_lock_run, staleflow_lock_run_read,
staleflow_idempotency_lookup) is applied with CREATE OR REPLACE, so a migrated database has
exactly what the files say. The definitions equal those migrations 0001-0007 created, which
stay as they were (history, reading frozen `*_v<N>.sql` copies where they read files).

A later change to a view or function edits its named DDL, freezes the definition it replaces
in a `*_v<N>.sql` file for its downgrade, and adds a migration that applies the named DDL
again (`apply_named_ddl`). This one applies the audit views as they were here (the frozen
`audit_views_v1.sql`: a later definition may need a later column) and the functions from the
files as they are (each only needs what exists at 0007).

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


AUDIT_VIEWS = "audit_views_v1.sql"  # frozen: the audit views as 0008 applied them


def apply_named_ddl(frozen_views: str | None = None) -> None:
    import sqlalchemy as sa

    from staleflow_db import queries

    for statement in queries.ddl_statements(frozen_views):
        op.execute(sa.text(statement))


def upgrade() -> None:
    apply_named_ddl(AUDIT_VIEWS)


def downgrade() -> None:
    """Nothing to undo: the named DDL equals the definitions 0001-0007 left (views and
    functions alike; tests/db/test_named_queries.py checks it), so the upgrade replaced each
    with itself."""
