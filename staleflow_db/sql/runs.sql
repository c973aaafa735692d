-- The run lock and what every run-locked transaction shares (staleflow_db/protocol/core.py):
-- the run row, buffer counters, reservations, the flush's parts, drops and commands.

-- name: load_run
SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p FROM runs WHERE id = :run

-- name: load_run_locked
-- NO KEY UPDATE, not UPDATE: it serializes run-locked transactions just the same, but leaves
-- FOR KEY SHARE free, which every FK check on runs takes (see load_run in base.py).
SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p FROM runs WHERE id = :run FOR NO KEY UPDATE

-- name: read_buffers
SELECT idx, occupied, reserved, consumed_at IS NOT NULL AS consumed FROM buffers
WHERE run_id = :run AND idx >= :first ORDER BY idx

-- name: lock_run
-- The run lock, the run row and its live buffers in one round trip (function_lock_run). It
-- marks the transaction's lock 'run' (`fast_locked`): a locked read sent after it reads.
SELECT staleflow_lock_run(CAST(:run AS bigint)) FROM (SELECT set_config('staleflow.lock', 'run', true)) AS m

-- name: group_locks
-- The group locks of a batch's samples' groups, in group id order (protocol/core.py,
-- "Group locks"): a transaction-scoped advisory lock per group, key (0x53460000 + id / 2^31,
-- id mod 2^31). group_id never changes: read without a lock. :samples the batch's sample ids.
SELECT count(pg_advisory_xact_lock(CAST(1397096448 + (x.g >> 31) AS int), CAST(x.g & 2147483647 AS int)))
FROM (SELECT DISTINCT group_id AS g FROM samples
  WHERE run_id = CAST(:run AS bigint) AND id = ANY(CAST(:samples AS bigint[])) ORDER BY 1) x

-- name: lock_run_then_groups
-- The run lock (`lock_run`, marking the transaction 'run'), then the batch's group locks
-- (`group_locks`), in one statement: the lock subquery, correlated with the run lock's result,
-- runs after it was granted; group_id never changes, so it needs no later snapshot.
-- The run row and buffers as `lock_run` returns them (NULL: no such run).
SELECT x.r FROM (SELECT staleflow_lock_run(CAST(:run AS bigint)) AS r,
  set_config('staleflow.lock', 'run', true) AS m OFFSET 0) x
WHERE (SELECT count(pg_advisory_xact_lock(CAST(1397096448 + (y.g >> 31) AS int), CAST(y.g & 2147483647 AS int)))
  FROM (SELECT DISTINCT group_id AS g FROM samples
    WHERE run_id = CAST(:run AS bigint) AND id = ANY(CAST(:samples AS bigint[])) ORDER BY 1) y
  WHERE x.r IS NOT NULL) >= 0

-- name: lock_groups_fast
-- The fast path's locks: the batch's group locks (`group_locks`), marking the transaction's
-- lock 'groups' (`fast_locked`) for the reads sent after it in the same round trip.
SELECT jsonb_build_object('groups', count(pg_advisory_xact_lock(CAST(1397096448 + (x.g >> 31) AS int),
  CAST(x.g & 2147483647 AS int))), 'lock', set_config('staleflow.lock', 'groups', true))
FROM (SELECT DISTINCT group_id AS g FROM samples
  WHERE run_id = CAST(:run AS bigint) AND id = ANY(CAST(:samples AS bigint[])) ORDER BY 1) x

-- name: fast_locked
-- Whether this transaction's last run or group lock was a fast path's group locks
-- (`lock_groups_fast`; 'run' after `lock_run` or `lock_run_then_groups`, the transaction-local
-- setting staleflow.lock): the reads pipelined after the lock statement read only on their path.
SELECT coalesce(current_setting('staleflow.lock', true), '') = 'groups'

-- name: route_groups_reserved
-- Whether every group of a route batch is reserved (unlocked: a guess, so that a batch that
-- will take the run lock does not first take group locks others wait for; `route_fast`).
SELECT NOT EXISTS (SELECT 1 FROM samples x JOIN prompt_groups y ON y.id = x.group_id
  WHERE x.run_id = CAST(:run AS bigint) AND x.id = ANY(CAST(:samples AS bigint[])) AND y.state <> 'reserved')

-- name: run_buffers
-- The run row and its live buffers as `staleflow_lock_run` returns them, without the run lock
-- (the fast paths of protocol/routing.py: they change no buffer accounting); nothing when the
-- statement before it took the run lock (`fast_locked`).
SELECT jsonb_build_object('run', to_jsonb(r), 'buffers', (
  SELECT coalesce(jsonb_agg(jsonb_build_array(idx, occupied, reserved, consumed_at IS NOT NULL) ORDER BY idx), '[]'::jsonb)
  FROM buffers WHERE run_id = r.id AND idx >= r.version)) FROM runs r WHERE r.id = CAST(:run AS bigint)
  AND coalesce(current_setting('staleflow.lock', true), '') = 'groups'

-- name: reservations
-- The run's reservations (id, buffer, live version); the members per group by a correlated
-- subquery: an index lookup each (uq_samples_group_id_idx). rewards_read (scoring.sql) has the same.
SELECT g.id, g.reserved_buffer AS b, (SELECT min(s.v_traj) FROM samples s WHERE s.group_id = g.id
  AND s.state <> 'aborted' AND s.v_traj IS NOT NULL AND (s.state <> 'queued' OR s.n_tokens > 0)) AS v
FROM prompt_groups g WHERE g.run_id = :run AND g.state = 'reserved'

-- name: flush_buffers
-- A part of the flush (`RunTx.flush`): the changed buffer counters.
INSERT INTO buffers (run_id, idx, batch_size, capacity, occupied, reserved)
SELECT :run, u.idx, :bs, :cap, u.occ, u.res
FROM unnest(CAST(:idx AS int[]), CAST(:occ AS int[]), CAST(:res AS int[])) AS u(idx, occ, res)
ON CONFLICT (run_id, idx) DO UPDATE
SET occupied = excluded.occupied, reserved = excluded.reserved

-- name: flush_moved
-- A part of the flush: the reservations that moved.
UPDATE prompt_groups g SET reserved_buffer = u.b
FROM unnest(CAST(:mids AS bigint[]), CAST(:mbs AS int[])) AS u(id, b)
WHERE g.id = u.id AND g.id = ANY(CAST(:mids AS bigint[])) AND g.state = 'reserved'

-- name: flush_done
-- What the flush's statement returns after its parts.
SELECT 1

-- name: drop_groups
UPDATE prompt_groups SET state = CAST(:state AS group_state), reason = :reason,
  reserved_buffer = NULL, finished_at = now() WHERE id = ANY(CAST(:ids AS bigint[]))

-- name: abort_samples
-- The live samples among :ids aborted (their instances' commands are sent after).
WITH s AS (SELECT id, instance_id, attempt FROM samples
  WHERE id = ANY(CAST(:ids AS bigint[])) AND state <> 'aborted' ORDER BY id FOR UPDATE),
u AS (UPDATE samples x SET state = 'aborted', reason = :reason, instance_id = NULL,
  reward_deadline = NULL, updated_at = now() FROM s WHERE x.id = s.id RETURNING x.id)
SELECT s.id, s.instance_id, s.attempt FROM s

-- name: abort_members
-- The live members of the groups :ids aborted, as abort_samples.
WITH s AS (SELECT id, instance_id, attempt FROM samples
  WHERE group_id = ANY(CAST(:ids AS bigint[])) AND state <> 'aborted' ORDER BY id FOR UPDATE),
u AS (UPDATE samples x SET state = 'aborted', reason = :reason, instance_id = NULL,
  reward_deadline = NULL, updated_at = now() FROM s WHERE x.id = s.id RETURNING x.id)
SELECT s.id, s.instance_id, s.attempt FROM s

-- name: send_commands
INSERT INTO commands (run_id, instance_id, kind, sample_id, attempt, epoch)
SELECT :run, u.inst, CAST(:kind AS command_kind), u.sid, u.att, :epoch
FROM unnest(CAST(:sids AS bigint[]), CAST(:insts AS bigint[]), CAST(:atts AS int[])) AS u(sid, inst, att)

-- name: function_lock_run
-- staleflow_lock_run(run): the per-run lock, the run row and its live buffers in one round
-- trip. Two statements inside one VOLATILE plpgsql function: under READ COMMITTED each takes
-- its own snapshot, so the buffers are read after the lock is granted and include the
-- previous holder's commit.
CREATE OR REPLACE FUNCTION staleflow_lock_run(p_run bigint) RETURNS jsonb LANGUAGE plpgsql VOLATILE AS $$
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

-- name: function_lock_run_read
-- staleflow_lock_run_read(run, query, ...): the run lock, its buffers and a caller's read
-- (EXECUTE'd, planned on every call) in one round trip. The protocol sends its locked reads
-- as prepared statements instead (protocol/driver.py); bench/locked_read.py compares the two.
CREATE OR REPLACE FUNCTION staleflow_lock_run_read(p_run bigint, p_query text, a bigint[], b bigint[], c int[], d float8[])
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

-- name: set_run_state
-- A lifecycle change (`RunOps.set_state`), under the run lock taken before.
UPDATE runs SET state = CAST(:state AS run_state), state_reason = :reason WHERE id = :run

-- name: unfinished_groups
-- What a cancel aborts: the run's groups not yet finished (queued or reserved), in id order.
SELECT id FROM prompt_groups WHERE run_id = :run AND state IN ('queued', 'reserved') ORDER BY id
