"""Segments keep a checkpoint's payload in the heap row (`toast_tuple_target = 4080`).

A checkpoint's partial segment carries up to CHECKPOINT_TOKENS tokens (workers/rollout/worker.py):
8 bytes a token of packed ids and log-probs, a row of ~110 + 8n bytes, ~3.9 KB at 480. Past
PostgreSQL's default target (~2 KB) its arrays went to TOAST: a compression attempt on
incompressible data, then chunks in the TOAST table and their index entries, ~21 buffers an
insert. Up to 4,080 bytes, the most of which two rows fit an 8-KB page, the row now stays whole:
~7 buffers, half the backend's time for the insert and 4-7% less WAL at 256-496 tokens; 4% less
heap at 480 (two rows a page instead of their TOAST chunks), 10-14% more at 256-384. A larger row is toasted down to that size
as before. It applies to rows written from now on: no rewrite, and the ALTER takes a SHARE
UPDATE EXCLUSIVE lock (reports and reads go on).

Revision ID: 0021
Revises: 0020
"""

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE segments SET (toast_tuple_target = 4080)")


def downgrade() -> None:
    op.execute("ALTER TABLE segments RESET (toast_tuple_target)")
