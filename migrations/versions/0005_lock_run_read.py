"""staleflow_lock_run_read(run, query, ...): the run lock, its buffers AND a caller's read in one round trip.

route and record_rewards used to send `staleflow_lock_run` and then their one locking read
(instances, samples, groups, members) as a second round trip under the run lock; every round
trip under it is time every other run-locked call waits (on a loaded 2-core host, waking the
client for the next statement is the larger part of it). Here the read runs as a third
statement inside the function: under READ COMMITTED it takes its own snapshot after the lock
is granted, so it sees everything the lock's previous holder committed, as the separate
statement did. The query (the caller's SQL, never user input) gets the run as $1 and four
typed arrays as $2..$5, and returns one jsonb value. With a NULL query only the lock and
buffers are read; a transaction that already holds the lock may call it again for the read
(the lock is then granted at once).

Revision ID: 0005
Revises: 0004
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

LOCK_RUN_READ = """
CREATE FUNCTION staleflow_lock_run_read(p_run bigint, p_query text, a bigint[], b bigint[], c int[], d float8[])
RETURNS jsonb LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r jsonb;
    got jsonb;
BEGIN
    -- NO KEY UPDATE: FK checks on runs (FOR KEY SHARE) stay free, see load_run
    SELECT to_jsonb(x) INTO r FROM (SELECT * FROM runs WHERE id = p_run FOR NO KEY UPDATE) x;
    IF r IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_query IS NOT NULL THEN
        EXECUTE p_query INTO got USING p_run, a, b, c, d;
    END IF;
    RETURN jsonb_build_object('run', r, 'read', got, 'buffers', (
        SELECT coalesce(jsonb_agg(jsonb_build_array(idx, occupied, reserved, consumed_at IS NOT NULL)
                                  ORDER BY idx), '[]'::jsonb)
        FROM buffers WHERE run_id = p_run AND idx >= (r ->> 'version')::int));
END
$$
"""


def upgrade() -> None:
    op.execute(LOCK_RUN_READ)


def downgrade() -> None:
    op.execute("DROP FUNCTION staleflow_lock_run_read(bigint, text, bigint[], bigint[], int[], float8[])")
