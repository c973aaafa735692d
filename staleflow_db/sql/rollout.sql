-- Rollout side of the protocol (staleflow_db/protocol/rollout.py; runs.py, core.py and routing.py
-- for runs, prompts and routing): runs, prompts, instances, routing (Reserve), segment reports
-- and work delivery.

-- name: create_run
INSERT INTO runs (name, batch_size, buffer_capacity, group_size, samples_per_group,
  eta, max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p)
VALUES (:name, :B, :Bc, :N, :Nc, :eta, :mr, :mp, :f, :t, :p) RETURNING id

-- name: enqueue_groups
-- The groups (a client key seen before is skipped) and their members, in one statement.
WITH g AS (INSERT INTO prompt_groups (run_id, client_key, prompt_tokens, meta, replacement_of)
  SELECT :run, x.k, x.t, coalesce(x.m, '{}'), x.r
  FROM jsonb_to_recordset(CAST(:p AS jsonb)) AS x(o int, k text, t int[], m jsonb, r bigint)
  ORDER BY x.o ON CONFLICT (run_id, client_key) DO NOTHING RETURNING id, client_key),
s AS (INSERT INTO samples (run_id, group_id, idx)
  SELECT :run, g.id, i FROM g, generate_series(0, :n - 1) AS i ORDER BY g.id, i)
SELECT id, client_key FROM g

-- name: groups_by_key
SELECT id, client_key FROM prompt_groups WHERE run_id = :run AND client_key = ANY(CAST(:keys AS text[]))

-- name: register_instance
INSERT INTO instances (run_id, name, version, lease_expires_at, lease_s, token_id, snapshot)
VALUES (:run, :name, :v, now() + make_interval(secs => :ttl), :ttl, :tok, CAST(:snap AS jsonb)) RETURNING id

-- name: heartbeat
-- Every condition re-checked on the row the UPDATE finally locks (RolloutOps.heartbeat). A
-- snapshot without a capacity keeps the one last reported (at registration or since).
-- Ephemeral: the statement turns synchronous commit off for its own transaction (SET LOCAL's
-- effect, without a round trip of its own); a volatile CTE is evaluated, once, for the join.
WITH ephemeral AS (SELECT set_config('synchronous_commit', 'off', true))
UPDATE instances i SET version = :v,
  snapshot = jsonb_strip_nulls(jsonb_build_object('capacity', i.snapshot->'capacity')) || CAST(:snap AS jsonb),
  snapshot_at = now(),
  lease_expires_at = now() + make_interval(secs => :ttl), lease_s = :ttl
FROM runs r, ephemeral WHERE i.id = :i AND r.id = i.run_id AND i.state::text = 'active'
AND i.lease_expires_at > now() AND i.version <= :v AND :v <= r.version RETURNING i.id

-- name: heartbeat_refused
SELECT i.state, i.lease_expires_at > now() AS live, i.version, r.version AS run_version
FROM instances i JOIN runs r ON r.id = i.run_id WHERE i.id = :i

-- name: expire_instances
UPDATE instances SET state = 'expired' WHERE id IN (SELECT id FROM instances
  WHERE run_id = :run AND state = 'active' AND lease_expires_at <= now() ORDER BY id FOR UPDATE)
RETURNING id

-- name: deregister_instance
UPDATE instances SET state = 'deregistered' WHERE id = :i AND state::text = 'active' RETURNING run_id

-- name: instance_exists
SELECT 1 FROM instances WHERE id = :i

-- name: requeue_fenced
-- Samples running on any fenced (non-active) instance of the run go back to the queue.
UPDATE samples x SET state = 'queued', instance_id = NULL, updated_at = now()
FROM (SELECT s.id, s.instance_id FROM samples s JOIN instances i ON i.id = s.instance_id
  WHERE s.run_id = :run AND s.state = 'running' AND i.state <> 'active' ORDER BY s.id FOR UPDATE OF s) AS f
WHERE x.id = f.id RETURNING x.id, f.instance_id

-- name: requeue_instances
-- Samples running on these instances (fenced in the same transaction) go back to the queue.
UPDATE samples x SET state = 'queued', instance_id = NULL, updated_at = now()
FROM (SELECT s.id, s.instance_id FROM samples s JOIN instances i ON i.id = s.instance_id
  WHERE s.run_id = :run AND s.state = 'running' AND s.instance_id = ANY(CAST(:ids AS bigint[])) ORDER BY s.id FOR UPDATE OF s) AS f
WHERE x.id = f.id RETURNING x.id, f.instance_id

-- name: poll_work
-- One statement checks the instance and delivers (RolloutOps.poll_work). The response so far
-- is the sample's segments' packed token_ids / logprobs concatenated in order, with each
-- segment's length and whether it was generated (the loss mask: 1 generated, 0 an environment
-- observation's). The poll renews the instance's live lease (`renew`, see
-- report_run_and_instances for why it runs first and writes only once a quarter of the lease
-- has passed); otherwise the instance is read FOR SHARE.
WITH renew AS MATERIALIZED (UPDATE instances SET lease_expires_at = now() + make_interval(secs => lease_s)
  WHERE id = :i AND state::text = 'active' AND lease_expires_at > now()
  AND lease_expires_at < now() + make_interval(secs => 0.75 * lease_s) RETURNING run_id),
held AS MATERIALIZED (SELECT i.state::text AS state, i.lease_expires_at > now() AS live,
  r.max_response_tokens FROM instances i JOIN runs r ON r.id = i.run_id WHERE i.id = :i
  AND NOT EXISTS (SELECT 1 FROM renew) FOR SHARE OF i),
inst AS MATERIALIZED (SELECT * FROM held UNION ALL
  SELECT 'active', true, r.max_response_tokens FROM renew JOIN runs r ON r.id = renew.run_id),
d AS MATERIALIZED (SELECT id FROM samples WHERE instance_id = :i AND state = 'running'
  AND NOT delivered AND (SELECT state = 'active' AND live FROM inst) ORDER BY id LIMIT :n FOR UPDATE),
u AS (UPDATE samples s SET delivered = true FROM d WHERE s.id = d.id
  RETURNING s.id, s.attempt, s.route_token, s.group_id, s.v_traj, s.n_tokens)
SELECT inst.state, inst.live, inst.max_response_tokens, w.* FROM inst LEFT JOIN (
  SELECT u.id, u.attempt, u.route_token::text AS route_token, u.group_id, u.v_traj, u.n_tokens, g.prompt_tokens,
  p.tokens, p.logprobs, p.lengths, p.generated, g.meta
  FROM u JOIN prompt_groups g ON g.id = u.group_id LEFT JOIN LATERAL (
    SELECT string_agg(x.token_ids, ''::bytea ORDER BY x.seq) AS tokens,
      string_agg(x.logprobs, ''::bytea ORDER BY x.seq) AS logprobs,
      array_agg(x.n_tokens ORDER BY x.seq) AS lengths, array_agg(x.generated ORDER BY x.seq) AS generated
    FROM segments x WHERE x.sample_id = u.id) p ON true) w
  ON true ORDER BY w.id

-- name: deliver_commands
-- Sent with `poll_work` in one round trip, as a statement of its own: its snapshot is taken
-- after the poll's sample locks were granted, so the abort of a sample the poll found aborted
-- when its lock was granted (surplus, drop) is delivered by this same poll. Sent whatever the
-- poll found, so it delivers nothing to an instance that is not active and live (the poll
-- holds its row: renewed, or FOR SHARE).
UPDATE commands SET state = 'delivered', delivered_at = now()
WHERE id IN (SELECT id FROM commands WHERE instance_id = :i AND state = 'pending'
  AND EXISTS (SELECT 1 FROM instances WHERE id = :i AND state::text = 'active' AND lease_expires_at > now())
  ORDER BY id FOR UPDATE) RETURNING id, kind, sample_id, attempt, target_version

-- name: poll_idle
-- Whether a poll of the instance now would only answer empty (RolloutOps.poll_idle): active,
-- its lease live and not due for the poll's renewal (`poll_work`'s `renew` condition), no
-- undelivered work, no pending command, no outcome stored under the request id :k (NULL: none
-- sent). NULL when there is no such instance.
SELECT i.state = 'active' AND i.lease_expires_at > now()
  AND i.lease_expires_at >= now() + make_interval(secs => 0.75 * i.lease_s)
  AND NOT EXISTS (SELECT 1 FROM samples WHERE instance_id = :i AND state = 'running' AND NOT delivered)
  AND NOT EXISTS (SELECT 1 FROM commands c WHERE c.instance_id = :i AND c.state = 'pending')
  AND NOT EXISTS (SELECT 1 FROM idempotency k WHERE k.request_id = CAST(:k AS text))
FROM instances i WHERE i.id = :i

-- name: interrupt_running
-- The samples f (of the run) and, for those running, their interrupt commands c, in one
-- statement; the coordinator's `cycle` has the same parts behind its fence.
WITH f AS MATERIALIZED (SELECT id, instance_id, attempt, state = 'running' AS running FROM samples
  WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))),
c AS (INSERT INTO commands (run_id, instance_id, kind, sample_id, attempt, epoch)
  SELECT :run, f.instance_id, 'interrupt', f.id, f.attempt, :epoch FROM f WHERE f.running
  ORDER BY f.id RETURNING id)
SELECT id, running FROM f

-- name: route_read
-- Everything route reads, in ONE statement, sent with the run lock (`RunTx.open`; see
-- protocol/routing.py for the lock order and why the groups and members are read by
-- `= ANY(ARRAY(...))`). :instances the batch's instance ids, :samples its sample ids. Nothing
-- is locked or read when the lock statement before it took the fast path's group locks
-- (`fast_locked`, a one-time filter: route_fast_read reads then).
WITH ok AS MATERIALIZED (SELECT coalesce(current_setting('staleflow.lock', true), '') <> 'groups' AS go),
i AS MATERIALIZED (SELECT id, state::text AS state, version, lease_expires_at > now() AS live
  FROM instances WHERE run_id = CAST(:run AS bigint) AND id = ANY(CAST(:instances AS bigint[])) AND (SELECT go FROM ok)
  ORDER BY id FOR SHARE),
s AS MATERIALIZED (SELECT id, group_id, state::text AS state, v_traj, n_tokens, last_version, attempt
  FROM samples WHERE run_id = CAST(:run AS bigint) AND id = ANY(CAST(:samples AS bigint[])) AND (SELECT go FROM ok)
  ORDER BY id FOR UPDATE),
g AS MATERIALIZED (SELECT id, state::text AS state, reserved_buffer, min_version FROM prompt_groups
  WHERE id = ANY(ARRAY(SELECT group_id FROM s)) ORDER BY id FOR UPDATE),
q(k, j) AS (SELECT 'i', to_jsonb(i) FROM i
  UNION ALL SELECT 's', to_jsonb(s) FROM s
  UNION ALL SELECT 'g', to_jsonb(g) || jsonb_build_object('mid', m.id, 'mstate', m.state::text,
    'mv', m.v_traj, 'mn', m.n_tokens) FROM g LEFT JOIN samples m ON m.group_id = g.id
    AND m.group_id = ANY(ARRAY(SELECT id FROM g WHERE state = 'reserved'))
    AND m.state <> 'aborted' AND m.v_traj IS NOT NULL)
SELECT coalesce(jsonb_agg(jsonb_build_array(k, j)), '[]') FROM q

-- name: route_fast_read
-- `route_read` for the fast path (protocol/routing.py), sent after the groups' group locks and
-- without the run lock: the same rows, but the groups unlocked (a route that goes without the
-- run lock writes no group row; a run-locked drop updates a group before it aborts its
-- members, so a group lock taken after a sample lock could deadlock with it). A batch with a
-- group not reserved goes under the run lock: then nothing is locked or read here (`ok`, a
-- one-time filter), and the empty result says so; nor when the statement before it took the
-- run lock (`fast_locked`: route_read reads then).
WITH ok AS MATERIALIZED (SELECT coalesce(current_setting('staleflow.lock', true), '') = 'groups'
  AND NOT EXISTS (SELECT 1 FROM samples x JOIN prompt_groups y ON y.id = x.group_id
  WHERE x.run_id = CAST(:run AS bigint) AND x.id = ANY(CAST(:samples AS bigint[])) AND y.state <> 'reserved') AS go),
i AS MATERIALIZED (SELECT id, state::text AS state, version, lease_expires_at > now() AS live
  FROM instances WHERE run_id = CAST(:run AS bigint) AND id = ANY(CAST(:instances AS bigint[])) AND (SELECT go FROM ok)
  ORDER BY id FOR SHARE),
s AS MATERIALIZED (SELECT id, group_id, state::text AS state, v_traj, n_tokens, last_version, attempt
  FROM samples WHERE run_id = CAST(:run AS bigint) AND id = ANY(CAST(:samples AS bigint[])) AND (SELECT go FROM ok)
  ORDER BY id FOR UPDATE),
g AS MATERIALIZED (SELECT id, state::text AS state, reserved_buffer, min_version FROM prompt_groups
  WHERE id = ANY(ARRAY(SELECT group_id FROM s))),
q(k, j) AS (SELECT 'i', to_jsonb(i) FROM i
  UNION ALL SELECT 's', to_jsonb(s) FROM s
  UNION ALL SELECT 'g', to_jsonb(g) || jsonb_build_object('mid', m.id, 'mstate', m.state::text,
    'mv', m.v_traj, 'mn', m.n_tokens) FROM g LEFT JOIN samples m ON m.group_id = g.id
    AND m.group_id = ANY(ARRAY(SELECT id FROM g WHERE state = 'reserved'))
    AND m.state <> 'aborted' AND m.v_traj IS NOT NULL)
SELECT coalesce(jsonb_agg(jsonb_build_array(k, j)), '[]') FROM q

-- name: route_samples
-- A part of the run lock's flush (`RunTx.defer`): the routed samples.
UPDATE samples s SET state = 'running', v_traj = u.v, instance_id = u.i, attempt = u.a,
  route_token = u.t, delivered = false, updated_at = now()
FROM unnest(CAST(:ids AS bigint[]), CAST(:vs AS int[]), CAST(:is AS bigint[]),
  CAST(:as AS int[]), CAST(:ts AS uuid[])) AS u(id, v, i, a, t)
WHERE s.id = u.id AND s.id = ANY(CAST(:ids AS bigint[]))

-- name: route_groups
-- A part of the run lock's flush (`RunTx.defer`): the groups the routes reserved or raised.
UPDATE prompt_groups g SET state = 'reserved', reserved_buffer = u.b, min_version = u.mv
FROM unnest(CAST(:ids AS bigint[]), CAST(:bs AS int[]), CAST(:mvs AS int[])) AS u(id, b, mv)
WHERE g.id = u.id AND g.id = ANY(CAST(:ids AS bigint[]))

-- name: report_run_and_instances
-- The run and the reporting instances; a run with no such instance still gives its one row.
-- A report renews the live leases of its instances (`renew`): only once a quarter of the lease
-- has passed, so a busy instance writes its row a few times a lease, not once a report; with a
-- snapshot (:snap not NULL, as a heartbeat's without the version) always, storing it. The
-- other instances are read FOR SHARE, in id order. `renew` runs first (the uncorrelated NOT
-- EXISTS is a one-time filter evaluated before the scan): a row it updated is never also
-- share-locked (`held`), so two calls of one instance never both hold a share lock and then
-- wait to upgrade it. A lapsed lease is not renewed: `live` stays false, the report is refused.
WITH renew AS MATERIALIZED (UPDATE instances x SET lease_expires_at = now() + make_interval(secs => x.lease_s),
  snapshot = CASE WHEN CAST(:snap AS jsonb) IS NULL THEN x.snapshot
    ELSE jsonb_strip_nulls(jsonb_build_object('capacity', x.snapshot->'capacity')) || CAST(:snap AS jsonb) END,
  snapshot_at = CASE WHEN CAST(:snap AS jsonb) IS NULL THEN x.snapshot_at ELSE now() END
  WHERE x.id IN (SELECT id FROM instances WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))
    AND state::text = 'active' AND lease_expires_at > now() AND (CAST(:snap AS jsonb) IS NOT NULL
    OR lease_expires_at < now() + make_interval(secs => 0.75 * lease_s)) ORDER BY id FOR NO KEY UPDATE)
  RETURNING x.id),
held AS MATERIALIZED (SELECT x.id AS iid, x.state::text AS istate, x.lease_expires_at > now() AS live
  FROM instances x WHERE x.run_id = :run AND x.id = ANY(CAST(:ids AS bigint[]))
  AND x.id <> ALL(ARRAY(SELECT id FROM renew)) ORDER BY x.id FOR SHARE)
SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p, i.iid, i.istate, i.live FROM runs LEFT JOIN LATERAL (
  SELECT * FROM held UNION ALL SELECT id, 'active', true FROM renew) i ON true
WHERE runs.id = :run

-- name: report_lock_running
-- Only the running rows are locked: a stale report must not wait on another sample's lock. By
-- id, never through ix_samples_running (`state::text`: see staleflow_db/schema.py).
-- last_generated: whether its last segment is a generated one (NULL: none yet), read only for
-- the samples :obs whose report is an observation (one a turn); NULL for the others.
SELECT id, state, attempt, v_traj, last_version, n_tokens, n_segments, instance_id, route_token,
  CASE WHEN id = ANY(CAST(:obs AS bigint[])) THEN (SELECT x.generated FROM segments x
    WHERE x.sample_id = samples.id AND x.seq = samples.n_segments - 1) END AS last_generated
FROM samples WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[])) AND state::text = 'running'
ORDER BY id FOR UPDATE

-- name: report_read_others
SELECT id, state, attempt, v_traj, last_version, n_tokens, n_segments, instance_id, route_token,
  NULL::boolean AS last_generated FROM samples WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))

-- name: report_segments
-- A part of `report_samples`' statement (`with_parts`): the segments. Their packed token ids
-- and log-probs (staleflow_db/payloads.py) come as two bytea arrays in the order of :p's rows.
-- An observation (g false) has no version.
INSERT INTO segments (sample_id, seq, run_id, version, instance_id, attempt, token_ids, logprobs,
  n_tokens, finish_reason, generated) SELECT x.s, x.q, :run, x.v, x.i, x.a, x.t, x.l, x.n, x.f, x.g
FROM ROWS FROM (jsonb_to_recordset(CAST(:p AS jsonb)) AS (s bigint, q int, v int, i bigint, a int, n int, f text, g boolean),
  unnest(CAST(:pt AS bytea[])), unnest(CAST(:pl AS bytea[]))) AS x(s, q, v, i, a, n, f, g, t, l)

-- name: report_samples
UPDATE samples s SET n_tokens = s.n_tokens + u.n, n_segments = s.n_segments + (u.n > 0)::int,
  last_version = CASE WHEN u.n > 0 AND u.v IS NOT NULL THEN u.v ELSE s.last_version END,
  state = CAST(u.st AS sample_state), instance_id = CASE WHEN u.st = 'running' THEN s.instance_id END,
  finish_reason = coalesce(u.f, s.finish_reason), updated_at = now()
FROM unnest(CAST(:ids AS bigint[]), CAST(:ns AS int[]), CAST(:vs AS int[]), CAST(:sts AS text[]),
  CAST(:fs AS text[])) AS u(id, n, v, st, f)
WHERE s.id = u.id AND s.id = ANY(CAST(:ids AS bigint[]))
