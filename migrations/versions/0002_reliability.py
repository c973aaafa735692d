"""Reliability: fencing columns (report identity, lease tokens) and the complete audit.

Revision ID: 0002
Revises: 0001

Each section below belongs to one concern; keep `schema.py` equal to what they create.
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


# ---- fencing: instance identity on reports, unguessable lease tokens ------------------------


def _fencing_upgrade() -> None:
    # The secret lease token of a sample's latest route (gen_random_uuid() at route time):
    # a report must quote it, so nobody can report for a sample by guessing its attempt.
    from sqlalchemy import BigInteger, Column
    from sqlalchemy.dialects.postgresql import UUID

    op.add_column("samples", Column("lease", UUID(as_uuid=True)))
    # The API token that registered an instance: only it (or an admin) may act for the instance.
    op.add_column("instances", Column("token_id", BigInteger))
    op.create_foreign_key(
        op.f("fk_instances_token_id"), "instances", "api_tokens", ["token_id"], ["id"], ondelete="SET NULL"
    )


def _fencing_downgrade() -> None:
    op.drop_constraint(op.f("fk_instances_token_id"), "instances", type_="foreignkey")
    op.drop_column("instances", "token_id")
    op.drop_column("samples", "lease")


# ---- protocol rules -------------------------------------------------------------------------


def _protocol_upgrade() -> None:
    pass


def _protocol_downgrade() -> None:
    pass


# ---- the complete audit ---------------------------------------------------------------------


# The complete `staleness_violations` view (same name and columns as 0001's, so every caller
# gets it unchanged). Its SQL is a versioned package file: a later migration that changes the
# view ships audit_v3.sql and leaves this one, so 0002 always creates exactly the same view.
AUDIT_SQL = "audit_v2.sql"


def _audit_view_sql(name: str) -> str:
    from importlib.resources import files

    return (files("staleflow_db") / "sql" / name).read_text(encoding="utf-8")


def _initial_violations_view() -> str:
    """0001's own definition of the view, read from that migration (the downgrade target)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_staleflow_0001", Path(__file__).with_name("0001_initial.py"))
    initial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(initial)
    views = initial.AUDIT_VIEWS
    return views[views.index("CREATE VIEW staleness_violations") :]


def _audit_upgrade() -> None:
    op.execute("DROP VIEW staleness_violations")
    op.execute(_audit_view_sql(AUDIT_SQL))


def _audit_downgrade() -> None:
    op.execute("DROP VIEW staleness_violations")
    op.execute(_initial_violations_view())


def upgrade() -> None:
    _fencing_upgrade()
    _protocol_upgrade()
    _audit_upgrade()


def downgrade() -> None:
    _audit_downgrade()
    _protocol_downgrade()
    _fencing_downgrade()
