"""Runs: a lifecycle state (active / paused / cancelled, with the reason given) and the
sampling parameters the rollout engines use (temperature, top_p; max tokens is
max_response_tokens). Existing runs are active and sampled at temperature 1, top_p 1.

Revision ID: 0013
Revises: 0012 (param_keys, after 0011_turns; the merger renumbers)
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

RUN_STATE = sa.Enum("active", "paused", "cancelled", name="run_state")


def upgrade() -> None:
    RUN_STATE.create(op.get_bind())
    # existing runs sampled at temperature 1 with the whole distribution
    for column in ("temperature", "top_p"):
        op.add_column("runs", sa.Column(column, sa.Double(), nullable=False, server_default="1"))
    op.add_column("runs", sa.Column("state", RUN_STATE, nullable=False, server_default="active"))
    op.add_column("runs", sa.Column("state_reason", sa.Text()))
    op.create_check_constraint(op.f("ck_runs_sampling"), "runs", "temperature > 0 AND top_p > 0 AND top_p <= 1")
    op.create_check_constraint(
        op.f("ck_runs_cancel_has_reason"), "runs", "state <> 'cancelled' OR state_reason IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_runs_cancel_has_reason"), "runs", type_="check")
    op.drop_constraint(op.f("ck_runs_sampling"), "runs", type_="check")
    for column in ("state_reason", "state", "top_p", "temperature"):
        op.drop_column("runs", column)
    RUN_STATE.drop(op.get_bind())
