"""staleflow_idempotency_lookup(key): a request id's lock and its stored outcome in one round trip.

Every keyed request (an API Idempotency-Key, a protocol `request_id`) first serializes on its
key and then looks for a stored outcome: two statements, and for the API's long-polls two
round trips on every re-check. Here both run inside one VOLATILE plpgsql function: under READ
COMMITTED the lookup takes its own snapshot after the lock is granted, so a concurrent
duplicate that waited sees the first one's committed outcome (a single SQL statement that
waited for the lock would still read from its older snapshot). The lock is the transaction
advisory lock the long-polls took before (`hashtextextended(key, 7)`).

Revision ID: 0006
Revises: 0005
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

LOOKUP = """
CREATE FUNCTION staleflow_idempotency_lookup(p_key text) RETURNS TABLE (operation text, response jsonb)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 7));
    RETURN QUERY SELECT i.operation, i.response FROM idempotency i WHERE i.request_id = p_key;
END
$$
"""


def upgrade() -> None:
    op.execute(LOOKUP)


def downgrade() -> None:
    op.execute("DROP FUNCTION staleflow_idempotency_lookup(text)")
