"""Observer tokens: a role that reads everything of a run and writes nothing (the dashboard).

Revision ID: 0003
Revises: 0002
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

ROLES = ("admin", "rollout", "reward", "trainer", "coordinator")


def upgrade() -> None:
    # PostgreSQL >= 12 allows ADD VALUE inside a transaction (the value is usable after commit).
    op.execute("ALTER TYPE token_role ADD VALUE IF NOT EXISTS 'observer'")


def downgrade() -> None:
    # An enum value cannot be dropped: rebuild the type without it (observer tokens go first).
    op.execute("DELETE FROM api_tokens WHERE role = 'observer'")
    op.execute("ALTER TYPE token_role RENAME TO token_role_old")
    op.execute(f"CREATE TYPE token_role AS ENUM ({', '.join(repr(r) for r in ROLES)})")
    op.execute("ALTER TABLE api_tokens ALTER COLUMN role TYPE token_role USING role::text::token_role")
    op.execute("DROP TYPE token_role_old")
