"""Parameter-server keys: each run's secret, from which the API derives the keys a parameter
server and its clients authenticate with (docs/security.md).

`param_keys` (run_id primary key, cascading with the run; secret bytea; created_at).

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "param_keys",
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("secret", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_param_keys_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_param_keys")),
    )


def downgrade() -> None:
    op.drop_table("param_keys")
