"""Reliability: fencing columns (report identity, lease tokens) and the complete audit.

Revision ID: 0002
Revises: 0001

Each section below belongs to one concern; keep `schema.py` equal to what they create.
"""

from alembic import op  # noqa: F401 - used by the sections

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


# ---- fencing: instance identity on reports, unguessable lease tokens ------------------------


def _fencing_upgrade() -> None:
    # The secret lease token of a sample's latest route (gen_random_uuid() at route time):
    # a report must quote it, so nobody can report for a sample by guessing its attempt.
    from sqlalchemy import Column
    from sqlalchemy.dialects.postgresql import UUID

    op.add_column("samples", Column("lease", UUID(as_uuid=True)))


def _fencing_downgrade() -> None:
    op.drop_column("samples", "lease")


# ---- protocol rules -------------------------------------------------------------------------


def _protocol_upgrade() -> None:
    pass


def _protocol_downgrade() -> None:
    pass


# ---- the complete audit ---------------------------------------------------------------------


def _audit_upgrade() -> None:
    pass


def _audit_downgrade() -> None:
    pass


def upgrade() -> None:
    _fencing_upgrade()
    _protocol_upgrade()
    _audit_upgrade()


def downgrade() -> None:
    _audit_downgrade()
    _protocol_downgrade()
    _fencing_downgrade()
