"""staleflow_lock_run(run): the per-run lock, the run row and its live buffers in one round trip.

Every transaction that changes buffer accounting starts with it. Two statements inside one
VOLATILE plpgsql function: under READ COMMITTED each takes its own snapshot, so the buffers
are read after the lock is granted and include the previous holder's commit (one SQL
statement that waited for the lock would still read the buffers from its older snapshot).

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

LOCK_RUN = """
CREATE FUNCTION staleflow_lock_run(p_run bigint) RETURNS jsonb LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r jsonb;
BEGIN
    -- NO KEY UPDATE: FK checks on runs (FOR KEY SHARE) stay free, see load_run
    SELECT to_jsonb(x) INTO r FROM (SELECT * FROM runs WHERE id = p_run FOR NO KEY UPDATE) x;
    IF r IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN jsonb_build_object('run', r, 'buffers', (
        SELECT coalesce(jsonb_agg(jsonb_build_array(idx, occupied, reserved, consumed_at IS NOT NULL)
                                  ORDER BY idx), '[]'::jsonb)
        FROM buffers WHERE run_id = p_run AND idx >= (r ->> 'version')::int));
END
$$
"""


def upgrade() -> None:
    op.execute(LOCK_RUN)


def downgrade() -> None:
    op.execute("DROP FUNCTION staleflow_lock_run(bigint)")
