-- Reward side of the protocol (staleflow_db/protocol/scoring.py): claiming finished samples,
-- recording rewards (Occupy and the DAPO filter) and aborts (protocol/aborts.py).

-- name: claim_reset_expired
-- Expired claims become claimable again: locked in id order, skipping rows another
-- transaction holds (a record_rewards posting late, under the run lock).
UPDATE samples SET state = 'finished', reward_deadline = NULL WHERE id IN (
SELECT id FROM samples WHERE run_id = :run AND state = 'scoring' AND reward_deadline <= now()
ORDER BY id FOR UPDATE SKIP LOCKED)

-- name: claim_idle
-- Whether a claim in the run would now only answer empty (ScoringOps.claim_idle): the run
-- exists, no sample is finished, no claim has expired (`claim_reset_expired` would free it),
-- no outcome is stored under the request id :k (NULL: none sent). One read, no lock. The
-- finished sample is looked for as the claim looks (first by id, its partial index): as an
-- EXISTS, a plan without :run's value expected to meet one soon in a scan of every sample.
SELECT EXISTS (SELECT 1 FROM runs WHERE id = :run)
  AND (SELECT id FROM samples WHERE run_id = :run AND state = 'finished' ORDER BY id LIMIT 1) IS NULL
  AND NOT EXISTS (SELECT 1 FROM samples WHERE run_id = :run AND state = 'scoring' AND reward_deadline <= now())
  AND NOT EXISTS (SELECT 1 FROM idempotency k WHERE k.request_id = CAST(:k AS text))

-- name: claim_rewards
-- Claim up to :n finished samples; the response is the segments' packed token_ids in order,
-- with each segment's length and whether it was generated (the loss mask: 1 generated, 0 an
-- environment observation's). The claimed ids as an array: a plan without :n's value (a
-- generic one) would otherwise expect a tenth of the table and join it by a hash over all samples.
WITH c AS MATERIALIZED (SELECT id FROM samples WHERE run_id = :run AND state = 'finished'
  ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED),
u AS (UPDATE samples s SET state = 'scoring', reward_attempt = s.reward_attempt + 1,
  reward_deadline = now() + make_interval(secs => :ttl), updated_at = now()
  WHERE s.id = ANY(ARRAY(SELECT id FROM c)) RETURNING s.id, s.reward_attempt, s.group_id, s.finish_reason)
SELECT u.id, u.reward_attempt, u.group_id, g.prompt_tokens,
  p.response, p.lengths, p.generated, u.finish_reason, g.meta
FROM u JOIN prompt_groups g ON g.id = u.group_id LEFT JOIN LATERAL (
  SELECT string_agg(x.token_ids, ''::bytea ORDER BY x.seq) AS response,
    array_agg(x.n_tokens ORDER BY x.seq) AS lengths, array_agg(x.generated ORDER BY x.seq) AS generated
  FROM segments x WHERE x.sample_id = u.id) p ON true
ORDER BY u.id

-- name: abort_candidates
SELECT s.id, s.group_id, s.state, g.state AS group_state
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE s.run_id = :run AND s.id = ANY(CAST(:ids AS bigint[]))

-- name: trajectory_drop_instance
-- The instance dropping trajectories (`drop_trajectories`): its live lease renewed as a report
-- renews it (`renew` first; see rollout.sql, report_run_and_instances), else FOR SHARE: it
-- stays active and live until the drop commits.
WITH renew AS MATERIALIZED (UPDATE instances SET lease_expires_at = now() + make_interval(secs => lease_s)
  WHERE id = :i AND run_id = :run AND state::text = 'active' AND lease_expires_at > now()
  AND lease_expires_at < now() + make_interval(secs => 0.75 * lease_s) RETURNING id),
held AS MATERIALIZED (SELECT state::text AS state, lease_expires_at > now() AS live FROM instances
  WHERE id = :i AND run_id = :run AND NOT EXISTS (SELECT 1 FROM renew) FOR SHARE)
SELECT state, live FROM held UNION ALL SELECT 'active', true FROM renew

-- name: trajectory_drop_candidates
-- The samples an instance drops, with their route, locked in id order (under the run lock).
SELECT s.id, s.group_id, s.state::text AS state, s.attempt, s.instance_id, s.route_token, s.reason,
  g.state::text AS group_state
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE s.run_id = :run AND s.id = ANY(CAST(:ids AS bigint[])) ORDER BY s.id FOR UPDATE OF s

-- name: live_members
SELECT group_id, count(*) FROM samples WHERE group_id = ANY(CAST(:g AS bigint[]))
AND state <> 'aborted' GROUP BY group_id

-- name: lock_group
SELECT state FROM prompt_groups WHERE id = :g AND run_id = :run FOR UPDATE

-- name: reward_drop_candidates
-- The claimed samples a reward worker drops (`drop_rewards`), locked in id order under the run
-- lock: a claim may not be reset (claim_reset_expired) between the check and the abort.
SELECT s.id, s.group_id, s.state::text AS state, s.reward_attempt, s.reason, g.state::text AS group_state
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE s.run_id = :run AND s.id = ANY(CAST(:ids AS bigint[])) ORDER BY s.id FOR UPDATE OF s

-- name: rewards_read
-- ONE statement, sent with the run lock (`RunTx.open`): lock the batch's samples, check every
-- claim and store the rewards only if all hold, then lock their groups and read the members
-- and the run's reservations (as `reservations` in runs.sql). See protocol/scoring.py for the
-- lock order and the index lookups. :samples the batch's sample ids (no duplicates), :attempts
-- their claim attempts, :rewards their rewards, :metrics their extra metrics (JSON text or NULL),
-- :scorer {the API token posting them} ({NULL} in-process). Nothing is locked, stored or read
-- when the lock statement before it took the fast path's group locks (`fast_locked`, a
-- one-time filter in `s`, which the rest reads, and in the reservations).
WITH ok AS MATERIALIZED (SELECT coalesce(current_setting('staleflow.lock', true), '') <> 'groups' AS go),
s AS MATERIALIZED (SELECT x.id, x.state::text AS state, x.group_id,
  x.state = 'scoring' AND x.reward_attempt = (CAST(:attempts AS int[]))[array_position(CAST(:samples AS bigint[]), x.id)] AS holds,
  (CAST(:rewards AS float8[]))[array_position(CAST(:samples AS bigint[]), x.id)] AS r,
  CAST((CAST(:metrics AS text[]))[array_position(CAST(:samples AS bigint[]), x.id)] AS jsonb) AS mx FROM samples x
  WHERE x.run_id = CAST(:run AS bigint) AND x.id = ANY(CAST(:samples AS bigint[])) AND (SELECT go FROM ok)
  ORDER BY x.id FOR UPDATE),
w AS (UPDATE samples x SET state = 'rewarded', reward = s.r, reward_metrics = s.mx,
  reward_token_id = (CAST(:scorer AS bigint[]))[1], reward_deadline = NULL, updated_at = now()
  FROM s WHERE x.id = s.id AND (SELECT count(*) FILTER (WHERE holds) FROM s) = cardinality(CAST(:samples AS bigint[]))),
g AS MATERIALIZED (SELECT id, state::text AS state, client_key, prompt_tokens, meta FROM prompt_groups
  WHERE id = ANY(ARRAY(SELECT group_id FROM s)) ORDER BY id FOR UPDATE),
q(k, j) AS (SELECT 's', to_jsonb(s) FROM s
  UNION ALL SELECT 'g', to_jsonb(g) FROM g
  UNION ALL SELECT 'm', jsonb_build_object('group_id', m.group_id, 'id', m.id, 'idx', m.idx,
    'state', m.state::text, 'v_traj', m.v_traj, 'reward', m.reward) FROM samples m
    WHERE m.group_id = ANY(ARRAY(SELECT id FROM g))
  UNION ALL SELECT 'r', to_jsonb(r) FROM (SELECT g.id, g.reserved_buffer AS b, (SELECT min(s.v_traj) FROM samples s WHERE s.group_id = g.id
    AND s.state <> 'aborted' AND s.v_traj IS NOT NULL AND (s.state <> 'queued' OR s.n_tokens > 0)) AS v
    FROM prompt_groups g WHERE g.run_id = CAST(:run AS bigint) AND g.state = 'reserved' AND (SELECT go FROM ok)) r)
SELECT coalesce(jsonb_agg(jsonb_build_array(k, j)), '[]') FROM q

-- name: rewards_fast_check
-- Whether a reward batch may be recorded without the run lock (`protocol/scoring.py`): the
-- run exists, every claim holds, and no reserved group of the batch reaches N rewarded members
-- with it (none is placed or filtered, so no buffer accounting changes). Sent after
-- `group_locks`, as a statement of its own: its snapshot has every reward of these
-- groups committed before.
SELECT k.rid IS NOT NULL AND r.id IS NOT NULL
  AND (SELECT count(*) FROM samples x WHERE x.run_id = r.id AND x.id = ANY(CAST(:samples AS bigint[]))
    AND x.state = 'scoring'
    AND x.reward_attempt = (CAST(:attempts AS int[]))[array_position(CAST(:samples AS bigint[]), x.id)])
    = cardinality(CAST(:samples AS bigint[]))
  AND NOT EXISTS (SELECT 1 FROM prompt_groups g
    WHERE g.id = ANY(ARRAY(SELECT x.group_id FROM samples x WHERE x.run_id = r.id AND x.id = ANY(CAST(:samples AS bigint[]))))
    AND g.state = 'reserved'
    AND (SELECT count(*) FROM samples m WHERE m.group_id = g.id
      AND (m.state = 'rewarded' OR m.id = ANY(CAST(:samples AS bigint[])))) >= r.group_size)
FROM (SELECT CAST(:run AS bigint) AS rid) k LEFT JOIN runs r ON r.id = k.rid

-- name: rewards_store
-- The fast path's write (`protocol/scoring.py`): lock the batch's samples in id order,
-- store the rewards and their `sample_rewarded` events only if every claim holds (as
-- `rewards_read`); returns [[sample, holds], ...].
WITH s AS MATERIALIZED (SELECT x.id,
  x.state = 'scoring' AND x.reward_attempt = (CAST(:attempts AS int[]))[array_position(CAST(:samples AS bigint[]), x.id)] AS holds,
  (CAST(:rewards AS float8[]))[array_position(CAST(:samples AS bigint[]), x.id)] AS r,
  CAST((CAST(:metrics AS text[]))[array_position(CAST(:samples AS bigint[]), x.id)] AS jsonb) AS mx FROM samples x
  WHERE x.run_id = CAST(:run AS bigint) AND x.id = ANY(CAST(:samples AS bigint[])) ORDER BY x.id FOR UPDATE),
ok AS MATERIALIZED (SELECT count(*) FILTER (WHERE holds) = cardinality(CAST(:samples AS bigint[])) AS all_hold FROM s),
w AS (UPDATE samples x SET state = 'rewarded', reward = s.r, reward_metrics = s.mx,
  reward_token_id = (CAST(:scorer AS bigint[]))[1], reward_deadline = NULL, updated_at = now()
  FROM s WHERE x.id = s.id AND (SELECT all_hold FROM ok)),
e AS (INSERT INTO events (run_id, kind, sample_id, data)
  SELECT CAST(:run AS bigint), 'sample_rewarded', u.id, jsonb_build_object('reward', u.r)
  FROM unnest(CAST(:samples AS bigint[]), CAST(:rewards AS float8[])) WITH ORDINALITY AS u(id, r, o)
  WHERE (SELECT all_hold FROM ok) ORDER BY u.o)
SELECT coalesce(jsonb_agg(jsonb_build_array(s.id, s.holds)), '[]') FROM s

-- name: occupy_groups
-- A part of the run lock's flush (`RunTx.defer`): the groups Occupy placed.
UPDATE prompt_groups g SET state = 'occupied', buffer = u.b, group_version = u.v, reserved_buffer = NULL
FROM unnest(CAST(:ids AS bigint[]), CAST(:bs AS int[]), CAST(:vs AS int[])) AS u(id, b, v)
WHERE g.id = u.id AND g.id = ANY(CAST(:ids AS bigint[]))
