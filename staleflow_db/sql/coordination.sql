-- Coordinator side (staleflow_db/protocol/coordination.py): leadership, the per-cycle
-- snapshot and the per-cycle commands, fenced by the leader's epoch.

-- name: acquire_leadership
INSERT INTO leader_epochs AS l (run_id, holder, epoch, expires_at)
VALUES (:run, :h, 1, now() + make_interval(secs => :ttl))
ON CONFLICT (run_id) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at,
  epoch = CASE WHEN l.holder = excluded.holder THEN l.epoch ELSE l.epoch + 1 END
WHERE l.holder = excluded.holder OR l.expires_at <= now()
RETURNING epoch

-- name: release_leadership
UPDATE leader_epochs SET expires_at = now() WHERE run_id = :run AND holder = :h

-- name: check_epoch
-- The coordinator fence: FOR SHARE holds off a takeover until this transaction commits.
SELECT holder, epoch FROM leader_epochs WHERE run_id = :run AND expires_at > now() FOR SHARE

-- name: instances_in_run
SELECT id FROM instances WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))

-- name: queue_pulls
-- A pull command t per (instance :is, target version :vs) for the run's active instances, and
-- its event e, in one statement (the coordinator's cycle_*pulls have the same parts). The events
-- are single rows of event_rows (the table behind the view `events`, migration 0016).
WITH t AS (INSERT INTO commands (run_id, instance_id, kind, target_version, epoch)
  SELECT :run, u.i, 'pull', u.v, :epoch FROM unnest(CAST(:is AS bigint[]), CAST(:vs AS int[]))
  WITH ORDINALITY AS u(i, v, o)
  JOIN instances x ON x.id = u.i AND x.run_id = :run AND x.state::text = 'active' ORDER BY u.o
  RETURNING id, instance_id, target_version),
e AS (INSERT INTO event_rows (run_id, kind, instance_id, data)
  SELECT :run, 'pull', t.instance_id, jsonb_build_object('target', t.target_version) FROM t ORDER BY t.id
  RETURNING id)
SELECT instance_id FROM t ORDER BY id

-- name: snapshot
-- The cycle's snapshot (`CoordinationOps.snapshot`): the run, its unconsumed buffers, its live
-- instances, their running samples, the queued samples (oldest first, up to :n) and the latest
-- published version, as one JSON array. Rows are arrays in the field order of the views they
-- become. The instances' filter is read once (CTE i) for them and their running samples. A
-- queued sample never routed (no V_traj: most of a queue) has no segments to look up.
WITH r AS MATERIALIZED (SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p FROM runs WHERE id = :run),
i AS MATERIALIZED (SELECT id, name, version, snapshot, extract(epoch FROM now() - snapshot_at)::float8 AS age
  FROM instances WHERE run_id = :run AND state = 'active' AND lease_expires_at > now())
SELECT json_build_array(
 (SELECT to_json(r) FROM r),
 (SELECT json_agg(json_build_array(b.idx, b.occupied, b.reserved) ORDER BY b.idx)
   FROM buffers b JOIN r ON b.run_id = r.id AND b.idx >= r.version),
 (SELECT json_agg(json_build_array(i.id, i.name, i.version, i.snapshot, i.age) ORDER BY i.id) FROM i),
 (SELECT json_agg(json_build_array(s.instance_id, s.id, s.n_tokens, cardinality(g.prompt_tokens), s.v_traj)
    ORDER BY s.id)
   FROM i JOIN samples s ON s.instance_id = i.id AND s.state = 'running'
   JOIN prompt_groups g ON g.id = s.group_id),
 (SELECT json_agg(json_build_array(q.id, q.group_id, q.v_traj, q.last_version, q.length, q.n_tokens, q.gstate,
    q.reserved_buffer, q.min_version,
    CASE WHEN q.v_traj IS NOT NULL THEN
     (SELECT x.instance_id FROM segments x WHERE x.sample_id = q.id ORDER BY x.seq DESC LIMIT 1) END)
    ORDER BY q.id)
   FROM (SELECT s.id, s.group_id, s.v_traj, s.last_version, cardinality(g.prompt_tokens) + s.n_tokens AS length,
     s.n_tokens, g.state::text AS gstate, g.reserved_buffer, g.min_version
     FROM samples s JOIN prompt_groups g ON g.id = s.group_id
     WHERE s.run_id = :run AND s.state = 'queued' ORDER BY s.id LIMIT :n) q),
 (SELECT max(version) FROM param_versions WHERE run_id = :run))

-- name: cycle_row
-- The cycle's row, written only while (:h, :e) hold the run's live leader epoch, held FOR SHARE to
-- the commit: the fence of a cycle with routes, checked last.
INSERT INTO coordinator_cycles (run_id, epoch, snapshot_ms, decide_ms, write_ms, routed,
  interrupted, pulled, migrated) SELECT l.run_id, l.epoch, :s, :d, :w, :r, :i, :p, :m
FROM leader_epochs l WHERE l.run_id = :run AND l.holder = :h AND l.epoch = :e
AND l.expires_at > now() FOR SHARE

-- name: cycle
-- A cycle without routes (most cycles) is this ONE statement, sent in autocommit: one round
-- trip from the decision to the commit. Interrupts (:ids, :n_ids distinct: f/c) and pulls
-- (:is, :vs: t/e) may be empty arrays, which write nothing. Nothing is written unless `ok`:
-- the leader epoch `l` is ours and live (held FOR SHARE to the statement's end, so no takeover
-- commits in between) and every sample to interrupt is in the run; the caller then raises what
-- the transaction raised. write_ms is the server's time from the statement's start to the
-- cycle row, taken after the commands and events are written (the CASE counts them first).
WITH l AS MATERIALIZED (SELECT run_id, epoch FROM leader_epochs WHERE run_id = :run AND holder = :h
  AND epoch = :epoch AND expires_at > now() FOR SHARE),
f AS MATERIALIZED (SELECT id, instance_id, attempt, state = 'running' AS running FROM samples
  WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))),
ok AS MATERIALIZED (SELECT FROM l WHERE (SELECT count(*) FROM f) = :n_ids),
c AS (INSERT INTO commands (run_id, instance_id, kind, sample_id, attempt, epoch)
  SELECT :run, f.instance_id, 'interrupt', f.id, f.attempt, :epoch FROM f WHERE f.running AND EXISTS (SELECT FROM ok)
  ORDER BY f.id RETURNING id),
t AS (INSERT INTO commands (run_id, instance_id, kind, target_version, epoch)
  SELECT :run, u.i, 'pull', u.v, :epoch FROM unnest(CAST(:is AS bigint[]), CAST(:vs AS int[]))
  WITH ORDINALITY AS u(i, v, o)
  JOIN instances x ON x.id = u.i AND x.run_id = :run AND x.state::text = 'active' WHERE EXISTS (SELECT FROM ok) ORDER BY u.o
  RETURNING id, instance_id, target_version),
e AS (INSERT INTO event_rows (run_id, kind, instance_id, data)
  SELECT :run, 'pull', t.instance_id, jsonb_build_object('target', t.target_version) FROM t ORDER BY t.id
  RETURNING id),
y AS (INSERT INTO coordinator_cycles (run_id, epoch, snapshot_ms, decide_ms, write_ms, routed, interrupted,
  pulled, migrated) SELECT l.run_id, l.epoch, :s, :d, CASE WHEN 0 + (SELECT count(*) FROM c) + (SELECT count(*) FROM e) >= 0
  THEN extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000 END, 0, :i, :p, :m FROM l, ok)
SELECT EXISTS (SELECT FROM l) AS fenced, ARRAY(SELECT id FROM f) AS found

-- name: snapshot_changes
-- The cycle's snapshot as changes since the reader's last one (`CoordinationOps.snapshot_changes`),
-- or whole (`whole`) when :since is NULL, pruned (below the run's horizon) or not from this server's
-- past. One JSON array: [position, whole, run, buffers, live instances [id, age], instance rows
-- [id, name, version, snapshot] (those written since; whole: all live), running rows (as
-- `snapshot`'s), queued rows (as `snapshot`'s, all of them when whole), gone sample ids, latest
-- published version]. `position`, this statement's snapshot (pg_snapshot as text), is the next
-- :since: a change this read did not see was written by a transaction at or after its xmax or in
-- progress at it (its xip list), and is read next time, whatever else runs long meanwhile
-- (migration 0019). A position longer than 4,000 characters (some 190 transactions in progress)
-- is given as `xmin:xmin:` instead: every transaction from the oldest in progress on is read
-- again next time, which repeats some changes (harmless) and keeps `since` short enough for a
-- URL. A changed sample is one a change row names, or a member of a group one
-- names; it comes back as running, queued or gone (neither). The changed samples are looked up by
-- primary key (`= ANY`): joined to `c`, a new run's rows estimated at 1 by stale statistics
-- gave a nested loop over every sample of the run per changed id (16 s at 8,000 changed). A
-- changed group's members likewise, by the unique (group_id, idx) index (`= ANY`): joined, the
-- generic plan hashed them against a scan of every sample the run ever had, on each read with a
-- group change; and their groups (`sg`) by primary key, not hashed against every group of the
-- server (the generic plan must also serve a whole read). An instance row was written since
-- when its xmin (32 bits: xids compared modulo 2^32) is at or after :since's xmax or in its xip.
WITH p AS MATERIALIZED (SELECT CASE WHEN length(CAST(pg_current_snapshot() AS text)) <= 4000
    THEN CAST(pg_current_snapshot() AS text)
    ELSE CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) || ':'
      || CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) || ':' END AS pos,
  CAST(CAST(pg_snapshot_xmax(pg_current_snapshot()) AS text) AS bigint) AS xmax),
q AS MATERIALIZED (SELECT CAST(CAST(pg_snapshot_xmax(t.v) AS text) AS bigint) AS xmax,
  ARRAY(SELECT CAST(CAST(x AS text) AS bigint) FROM pg_snapshot_xip(t.v) AS x) AS xip
  FROM (SELECT CAST(CAST(:since AS text) AS pg_snapshot) AS v) AS t),
f AS MATERIALIZED (SELECT q.xmax IS NULL OR q.xmax > p.xmax
  OR least(q.xmax, (SELECT min(x) FROM unnest(q.xip) AS x))
   < coalesce((SELECT h.pruned_below FROM snapshot_horizons h WHERE h.run_id = :run), 0)
  AS whole FROM p, q),
r AS MATERIALIZED (SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p FROM runs WHERE id = :run),
i AS MATERIALIZED (SELECT id, name, version, snapshot, extract(epoch FROM now() - snapshot_at)::float8 AS age,
  ((CAST(CAST(xmin AS text) AS bigint) - (SELECT xmax FROM q)) & 4294967295) < 2147483648
  OR CAST(CAST(xmin AS text) AS bigint) IN (SELECT x & 4294967295 FROM q, unnest(q.xip) AS x) AS written
  FROM instances WHERE run_id = :run AND state = 'active' AND lease_expires_at > now()),
c AS MATERIALIZED (SELECT DISTINCT u.id FROM snapshot_changes x CROSS JOIN LATERAL unnest(x.sample_ids) AS u(id)
  WHERE x.run_id = :run AND (x.xid >= (SELECT xmax FROM q) OR x.xid = ANY(CAST((SELECT xip FROM q) AS bigint[])))
  AND x.sample_ids IS NOT NULL AND NOT (SELECT whole FROM f)
  UNION
  SELECT s.id FROM samples s WHERE s.group_id = ANY(ARRAY(SELECT u.id FROM snapshot_changes x
    CROSS JOIN LATERAL unnest(x.group_ids) AS u(id)
    WHERE x.run_id = :run AND (x.xid >= (SELECT xmax FROM q) OR x.xid = ANY(CAST((SELECT xip FROM q) AS bigint[])))
    AND x.group_ids IS NOT NULL AND NOT (SELECT whole FROM f)))),
s AS MATERIALIZED (SELECT s.* FROM samples s WHERE s.id = ANY(ARRAY(SELECT id FROM c)) AND s.run_id = :run
  UNION ALL
  SELECT s.* FROM samples s WHERE (SELECT whole FROM f) AND s.run_id = :run AND s.state = 'queued'
  UNION ALL
  SELECT s.* FROM instances a JOIN samples s ON s.instance_id = a.id AND s.state = 'running'
  WHERE (SELECT whole FROM f) AND a.run_id = :run AND a.state = 'active'),
sg AS MATERIALIZED (SELECT id, state::text AS state, reserved_buffer, min_version, cardinality(prompt_tokens) AS prompt_len
  FROM prompt_groups WHERE id = ANY(ARRAY(SELECT DISTINCT group_id FROM s WHERE state IN ('running', 'queued'))))
SELECT json_build_array(
 (SELECT pos FROM p),
 (SELECT whole FROM f),
 (SELECT to_json(r) FROM r),
 (SELECT json_agg(json_build_array(b.idx, b.occupied, b.reserved) ORDER BY b.idx)
   FROM buffers b JOIN r ON b.run_id = r.id AND b.idx >= r.version),
 (SELECT json_agg(json_build_array(i.id, i.age) ORDER BY i.id) FROM i),
 (SELECT json_agg(json_build_array(i.id, i.name, i.version, i.snapshot) ORDER BY i.id) FROM i
   WHERE i.written IS NOT FALSE OR (SELECT whole FROM f)),
 (SELECT json_agg(json_build_array(s.instance_id, s.id, s.n_tokens, g.prompt_len, s.v_traj)
    ORDER BY s.id)
   FROM s JOIN sg g ON g.id = s.group_id WHERE s.state = 'running'),
 (SELECT json_agg(json_build_array(s.id, s.group_id, s.v_traj, s.last_version,
    g.prompt_len + s.n_tokens, s.n_tokens, g.state, g.reserved_buffer, g.min_version,
    CASE WHEN s.v_traj IS NOT NULL THEN
     (SELECT x.instance_id FROM segments x WHERE x.sample_id = s.id ORDER BY x.seq DESC LIMIT 1) END)
    ORDER BY s.id)
   FROM s JOIN sg g ON g.id = s.group_id WHERE s.state = 'queued'),
 (SELECT json_agg(s.id ORDER BY s.id) FROM s WHERE s.state NOT IN ('queued', 'running')),
 (SELECT max(version) FROM param_versions WHERE run_id = :run))

-- name: prune_snapshot_changes
-- Forget a run's snapshot changes older than :keep_s seconds, raising its horizon past them: a
-- delta from below the horizon is answered whole.
WITH d AS (DELETE FROM snapshot_changes WHERE run_id = :run AND at < now() - make_interval(secs => :keep_s)
  RETURNING xid)
INSERT INTO snapshot_horizons AS h (run_id, pruned_below) SELECT :run, max(xid) + 1 FROM d HAVING count(*) > 0
ON CONFLICT (run_id) DO UPDATE SET pruned_below = greatest(h.pruned_below, excluded.pruned_below)
RETURNING pruned_below
