-- Node sync (staleflow_db/protocol/node.py): the calls of several instances one process hosts,
-- folded into set-based statements.

-- name: node_instances
-- The instances of a node sync's items and the run, in ONE statement: what `rollout.sql`'s
-- report_run_and_instances does for a report (renew or FOR SHARE) and `heartbeat` for a
-- heartbeat, for every item at once. :p holds one object per item: i its instance, r whether
-- it reports, s the snapshot riding its reports (NULL: none), and its heartbeat's version v
-- (NULL: no heartbeat), snapshot h and lease seconds t.
-- `w` writes every instance that a heartbeat, a snapshot or a lease a quarter spent makes
-- write, each locked once in its final mode, in one pass by id: a later upgrade of a share lock
-- could wait on a route holding that row while the route waits on this one. Its row is what
-- the item's report and then its heartbeat leave: a heartbeat keeps the capacity its report's
-- snapshot carries, else the stored one. Every condition of a heartbeat (live, active, version
-- never backwards) sits in the UPDATE itself, re-checked on the row it finally locks: an item
-- whose heartbeat did not write is not in `w`, and its beat is then refused as `heartbeat`
-- refuses it. The reporting instances `w` did not write are read FOR SHARE (`held`, after it).
-- :eph turns synchronous commit off for the transaction (a sync of heartbeats only, as
-- `heartbeat`'s ephemeral).
WITH ephemeral AS (SELECT CASE WHEN CAST(:eph AS boolean) THEN set_config('synchronous_commit', 'off', true) END),
u AS MATERIALIZED (SELECT * FROM jsonb_to_recordset(CAST(:p AS jsonb))
  AS u(i bigint, r boolean, s jsonb, v int, h jsonb, t float8)),
w AS MATERIALIZED (UPDATE instances x SET version = coalesce(u.v, x.version),
  snapshot = CASE WHEN u.v IS NOT NULL
      THEN jsonb_strip_nulls(jsonb_build_object('capacity', coalesce(u.s->'capacity', x.snapshot->'capacity'))) || u.h
    WHEN u.s IS NOT NULL THEN jsonb_strip_nulls(jsonb_build_object('capacity', x.snapshot->'capacity')) || u.s
    ELSE x.snapshot END,
  snapshot_at = CASE WHEN u.v IS NULL AND u.s IS NULL THEN x.snapshot_at ELSE now() END,
  lease_expires_at = now() + make_interval(secs => coalesce(u.t, x.lease_s)), lease_s = coalesce(u.t, x.lease_s)
  FROM u, runs r, ephemeral
  WHERE x.id = u.i AND r.id = x.run_id AND x.state = 'active' AND x.lease_expires_at > now()
  AND (u.v IS NULL OR (x.version <= u.v AND u.v <= r.version))
  AND x.id IN (SELECT y.id FROM instances y JOIN u ON u.i = y.id WHERE y.run_id = CAST(:run AS bigint)
    AND y.state = 'active' AND y.lease_expires_at > now() AND (u.v IS NOT NULL OR u.s IS NOT NULL
    OR y.lease_expires_at < now() + make_interval(secs => 0.75 * y.lease_s)) ORDER BY y.id FOR NO KEY UPDATE OF y)
  RETURNING x.id, u.v IS NOT NULL AS beat),
held AS MATERIALIZED (SELECT x.id AS iid, x.state::text AS istate, x.lease_expires_at > now() AS live, false AS beat
  FROM instances x WHERE x.run_id = CAST(:run AS bigint) AND x.id = ANY(ARRAY(SELECT u.i FROM u WHERE u.r))
  AND x.id <> ALL(ARRAY(SELECT id FROM w)) ORDER BY x.id FOR SHARE)
SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p, i.iid, i.istate, i.live, i.beat
FROM runs LEFT JOIN LATERAL (SELECT * FROM held UNION ALL SELECT id, 'active', true, beat FROM w) i ON true
WHERE runs.id = CAST(:run AS bigint)

-- name: node_poll
-- `rollout.sql`'s poll_work for the instances :ids in ONE statement (RolloutOps.poll_node): each
-- instance renewed when a quarter of its lease is spent (`renew`, one pass by id) or else read
-- FOR SHARE (`held`, after it), all before any sample (lock order instances -> samples); then
-- each active, live instance's undelivered samples, at most :n per instance, locked and marked
-- delivered, instance after instance by id. One row per delivered sample, one with no sample
-- for an instance with none; no row for an instance that does not exist.
WITH renew AS MATERIALIZED (UPDATE instances x SET lease_expires_at = now() + make_interval(secs => x.lease_s)
  WHERE x.id IN (SELECT id FROM instances WHERE id = ANY(CAST(:ids AS bigint[])) AND state = 'active'
    AND lease_expires_at > now() AND lease_expires_at < now() + make_interval(secs => 0.75 * lease_s)
    ORDER BY id FOR NO KEY UPDATE)
  RETURNING x.id, x.run_id),
held AS MATERIALIZED (SELECT i.id, i.state::text AS state, i.lease_expires_at > now() AS live,
  r.max_response_tokens FROM instances i JOIN runs r ON r.id = i.run_id WHERE i.id = ANY(CAST(:ids AS bigint[]))
  AND i.id <> ALL(ARRAY(SELECT id FROM renew)) ORDER BY i.id FOR SHARE OF i),
inst AS MATERIALIZED (SELECT * FROM held UNION ALL
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
  AND EXISTS (SELECT 1 FROM instances i WHERE i.id = c.instance_id AND i.state = 'active' AND i.lease_expires_at > now())
  ORDER BY c.id FOR UPDATE) RETURNING id, instance_id, kind, sample_id, attempt, target_version
