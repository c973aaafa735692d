-- Node sync (staleflow_db/protocol/node.py): the calls of several instances one process hosts,
-- folded into set-based statements.
--
-- Each statement locks its instances in ONE pass by id, each row once and in its final mode
-- (`lk`: for each id in order, FOR NO KEY UPDATE when the call writes the row, else FOR SHARE):
-- as the instances' own calls one after another lock them. Two passes (the writes' rows, then
-- the others') could deadlock with another call doing the same to the same rows in other modes
-- (a node's flush and its long-poll), and a share lock upgraded later could wait on a route
-- holding the row while the route waits on this one.
--
-- Instances named by id are matched on `state::text = 'active'`: never through the partial index
-- of a run's live instances, whose whole the planner may read per id on a young run's statistics
-- (staleflow_db/schema.py, ix_instances_active).

-- name: node_instances
-- The instances of a node sync's items and the run, in ONE statement: what `rollout.sql`'s
-- report_run_and_instances does for a report (renew or FOR SHARE) and `heartbeat` for a
-- heartbeat, for every item at once. :p holds one object per item: i its instance, r whether
-- it reports, s the snapshot riding its reports (NULL: none), and its heartbeat's version v
-- (NULL: no heartbeat), snapshot h and lease seconds t.
-- `w` writes the instances that a heartbeat, a snapshot or a lease a quarter spent makes write
-- (locked FOR NO KEY UPDATE by `lk`), each row as the item's report and then its heartbeat leave
-- it: a heartbeat keeps the capacity its report's snapshot carries, else the stored one. Every
-- condition of a heartbeat (live, active, version never backwards) sits in the UPDATE itself,
-- re-checked on the row it finally locks: an item whose heartbeat did not write is not in `w`
-- (its beat is then refused as `heartbeat` refuses it). The other reporting instances are read
-- FOR SHARE by `lk`, which gives their state. :eph turns synchronous commit off for the
-- transaction (a sync of heartbeats only, as `heartbeat`'s ephemeral).
WITH ephemeral AS (SELECT CASE WHEN CAST(:eph AS boolean) THEN set_config('synchronous_commit', 'off', true) END),
u AS MATERIALIZED (SELECT * FROM jsonb_to_recordset(CAST(:p AS jsonb))
  AS u(i bigint, r boolean, s jsonb, v int, h jsonb, t float8)),
lk AS MATERIALIZED (SELECT u.i, x.id AS xid, y.state AS ystate, y.live AS ylive
  FROM (SELECT * FROM u ORDER BY i) u
  LEFT JOIN LATERAL (SELECT id FROM instances WHERE id = u.i AND run_id = CAST(:run AS bigint) AND state::text = 'active'
    AND lease_expires_at > now() AND (u.v IS NOT NULL OR u.s IS NOT NULL
    OR lease_expires_at < now() + make_interval(secs => 0.75 * lease_s)) FOR NO KEY UPDATE) x ON true
  LEFT JOIN LATERAL (SELECT state::text AS state, lease_expires_at > now() AS live FROM instances
    WHERE id = u.i AND run_id = CAST(:run AS bigint) AND u.r AND x.id IS NULL FOR SHARE) y ON true),
w AS MATERIALIZED (UPDATE instances x SET version = coalesce(u.v, x.version),
  snapshot = CASE WHEN u.v IS NOT NULL
      THEN jsonb_strip_nulls(jsonb_build_object('capacity', coalesce(u.s->'capacity', x.snapshot->'capacity'))) || u.h
    WHEN u.s IS NOT NULL THEN jsonb_strip_nulls(jsonb_build_object('capacity', x.snapshot->'capacity')) || u.s
    ELSE x.snapshot END,
  snapshot_at = CASE WHEN u.v IS NULL AND u.s IS NULL THEN x.snapshot_at ELSE now() END,
  lease_expires_at = now() + make_interval(secs => coalesce(u.t, x.lease_s)), lease_s = coalesce(u.t, x.lease_s)
  FROM u, runs r, ephemeral
  WHERE x.id = u.i AND x.id = ANY(ARRAY(SELECT xid FROM lk)) AND r.id = x.run_id AND x.state::text = 'active'
  AND x.lease_expires_at > now() AND (u.v IS NULL OR (x.version <= u.v AND u.v <= r.version))
  RETURNING x.id, u.v IS NOT NULL AS beat)
SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p, i.iid, i.istate, i.live, i.beat
FROM runs LEFT JOIN LATERAL (SELECT lk.i AS iid, lk.ystate AS istate, lk.ylive AS live, false AS beat FROM lk
  WHERE lk.ystate IS NOT NULL UNION ALL SELECT id, 'active', true, beat FROM w) i ON true
WHERE runs.id = CAST(:run AS bigint)

-- name: node_poll
-- `rollout.sql`'s poll_work for the instances :ids in ONE statement (RolloutOps.poll_node): each
-- instance renewed when a quarter of its lease is spent (`renew`; `lk` locks it FOR NO KEY
-- UPDATE) or else read FOR SHARE (by `lk`), all before any sample (lock order instances ->
-- samples); then each active, live instance's undelivered samples, at most :n per instance,
-- locked and marked delivered, instance after instance by id. One row per delivered sample,
-- one with no sample for an instance with none; no row for an instance that does not exist.
WITH lk AS MATERIALIZED (SELECT k.i, x.id AS xid, y.state AS ystate, y.live AS ylive, y.run_id AS yrun
  FROM (SELECT DISTINCT i FROM unnest(CAST(:ids AS bigint[])) AS i ORDER BY i) k
  LEFT JOIN LATERAL (SELECT id FROM instances WHERE id = k.i AND state::text = 'active' AND lease_expires_at > now()
    AND lease_expires_at < now() + make_interval(secs => 0.75 * lease_s) FOR NO KEY UPDATE) x ON true
  LEFT JOIN LATERAL (SELECT state::text AS state, lease_expires_at > now() AS live, run_id FROM instances
    WHERE id = k.i AND x.id IS NULL FOR SHARE) y ON true),
renew AS MATERIALIZED (UPDATE instances x SET lease_expires_at = now() + make_interval(secs => x.lease_s)
  WHERE x.id = ANY(ARRAY(SELECT xid FROM lk)) AND x.state::text = 'active' AND x.lease_expires_at > now()
  RETURNING x.id, x.run_id),
inst AS MATERIALIZED (SELECT lk.i AS id, lk.ystate AS state, lk.ylive AS live, r.max_response_tokens
  FROM lk JOIN runs r ON r.id = lk.yrun UNION ALL
  SELECT renew.id, 'active', true, r.max_response_tokens FROM renew JOIN runs r ON r.id = renew.run_id),
d AS MATERIALIZED (SELECT s.id FROM (SELECT id FROM inst WHERE state = 'active' AND live ORDER BY id) k
  CROSS JOIN LATERAL (SELECT id FROM samples WHERE instance_id = k.id AND state = 'running' AND NOT delivered
    ORDER BY id LIMIT CAST(:n AS int) FOR UPDATE) s),
u AS (UPDATE samples s SET delivered = true FROM d WHERE s.id = d.id
  RETURNING s.id, s.instance_id, s.attempt, s.route_token, s.group_id, s.v_traj, s.n_tokens)
SELECT inst.id AS iid, inst.state, inst.live, inst.max_response_tokens, w.* FROM inst LEFT JOIN (
  SELECT u.id, u.instance_id, u.attempt, u.route_token::text AS route_token, u.group_id, u.v_traj, u.n_tokens,
  g.prompt_tokens, p.tokens, p.logprobs, p.lengths, p.generated, g.meta
  FROM u JOIN prompt_groups g ON g.id = u.group_id LEFT JOIN LATERAL (
    SELECT string_agg(x.token_ids, ''::bytea ORDER BY x.seq) AS tokens,
      string_agg(x.logprobs, ''::bytea ORDER BY x.seq) AS logprobs,
      array_agg(x.n_tokens ORDER BY x.seq) AS lengths, array_agg(x.generated ORDER BY x.seq) AS generated
    FROM segments x WHERE x.sample_id = u.id) p ON true) w
  ON w.instance_id = inst.id ORDER BY inst.id, w.id

-- name: node_commands
-- `rollout.sql`'s deliver_commands for the instances :ids, sent with `node_poll` in one round
-- trip as a statement of its own (its snapshot follows the poll's sample locks): the pending
-- commands of each instance that is active and live (the poll holds its row).
UPDATE commands SET state = 'delivered', delivered_at = now()
WHERE id IN (SELECT c.id FROM commands c WHERE c.instance_id = ANY(CAST(:ids AS bigint[])) AND c.state = 'pending'
  AND EXISTS (SELECT 1 FROM instances i WHERE i.id = c.instance_id AND i.state::text = 'active' AND i.lease_expires_at > now())
  ORDER BY c.id FOR UPDATE) RETURNING id, instance_id, kind, sample_id, attempt, target_version

-- name: node_poll_idle
-- Whether a node poll of the instances :ids now would only answer empty deliveries
-- (NodeOps.poll_node_idle): `rollout.sql`'s poll_idle true for every one of them (active, its
-- lease live and not due for the poll's renewal, no undelivered work, no pending command), and
-- no outcome stored under the request id :k (NULL: none sent). An instance that does not exist
-- makes it false (its poll: 404), as an empty :ids does.
SELECT coalesce(bool_and(i.id IS NOT NULL AND i.state = 'active' AND i.lease_expires_at > now()
    AND i.lease_expires_at >= now() + make_interval(secs => 0.75 * i.lease_s)
    AND NOT EXISTS (SELECT 1 FROM samples WHERE instance_id = i.id AND state = 'running' AND NOT delivered)
    AND NOT EXISTS (SELECT 1 FROM commands c WHERE c.instance_id = i.id AND c.state = 'pending')), false)
  AND NOT EXISTS (SELECT 1 FROM idempotency k WHERE k.request_id = CAST(:k AS text))
FROM unnest(CAST(:ids AS bigint[])) AS u(id) LEFT JOIN LATERAL (SELECT * FROM instances WHERE id = u.id) i ON true
