"""One name per concept where "lease" named five: a sample's route token, a buffer's consume
fence, a coordinator's leader epoch (an instance's lease keeps its name; a reward claim's
columns were already `reward_attempt` / `reward_deadline`).

    samples.lease              -> samples.route_token
    buffers.lease              -> buffers.consume_fence
    buffers.leased_at          -> buffers.consume_fence_at
    coordinator_leases         -> leader_epochs (pk_leader_epochs, fk_leader_epochs_run_id)

Renames only: no data moves. No view or function of the named DDL reads a renamed column or
table (PostgreSQL would follow the rename in a view anyway: it stores column numbers), so the
named DDL is unchanged and 0008 still applies it at 0007's schema; a downgrade to 0007 and an
upgrade back leave every view and function as they were (tests/db/test_db.py).

Revision ID: 0010
Revises: 0009
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

COLUMNS = [  # (table, old, new)
    ("samples", "lease", "route_token"),
    ("buffers", "lease", "consume_fence"),
    ("buffers", "leased_at", "consume_fence_at"),
]
TABLES = [("coordinator_leases", "leader_epochs")]  # (old, new): its pk and fk follow the name
CONSTRAINTS = [  # (table as renamed, old, new)
    ("leader_epochs", "pk_coordinator_leases", "pk_leader_epochs"),
    ("leader_epochs", "fk_coordinator_leases_run_id", "fk_leader_epochs_run_id"),
]


def _rename_not_null_constraints(tables: list[str], table_names: dict[str, str], column_names: dict[str, str]) -> None:
    """PostgreSQL 18 keeps NOT NULL constraints in pg_constraint, named `<table>_<column>_not_null`
    when created, and a rename leaves those names behind: they follow here (older servers have
    none, so this does nothing there)."""
    import sqlalchemy as sa

    rows = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT c.conrelid::regclass::text AS tbl, c.conname, a.attname FROM pg_constraint c"
                " JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]"
                " WHERE c.contype = 'n' AND c.conrelid::regclass::text = ANY(:tables)"
            ),
            {"tables": tables},
        )
        .all()
    )
    for tbl, conname, column in rows:
        old_table = next((o for o, n in table_names.items() if n == tbl), tbl)
        old_column = next((o for (t, o), n in column_names.items() if t == tbl and n == column), column)
        if conname == f"{old_table}_{old_column}_not_null" and (old_table, old_column) != (tbl, column):
            op.execute(f"ALTER TABLE {tbl} RENAME CONSTRAINT {conname} TO {tbl}_{column}_not_null")


def upgrade() -> None:
    for table, old, new in COLUMNS:
        op.alter_column(table, old, new_column_name=new)
    for old, new in TABLES:
        op.rename_table(old, new)
    for table, old, new in CONSTRAINTS:
        op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT {old} TO {new}")
    _rename_not_null_constraints(
        ["samples", "buffers", *(n for _, n in TABLES)],
        dict(TABLES),
        {(t, o): n for t, o, n in COLUMNS},
    )


def downgrade() -> None:
    for table, old, new in reversed(CONSTRAINTS):
        op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT {new} TO {old}")
    for old, new in reversed(TABLES):
        op.rename_table(new, old)
    for table, old, new in reversed(COLUMNS):
        op.alter_column(table, new, new_column_name=old)
    _rename_not_null_constraints(
        ["samples", "buffers", *(o for o, _ in TABLES)],
        {n: o for o, n in TABLES},
        {(t, n): o for t, o, n in COLUMNS},
    )
