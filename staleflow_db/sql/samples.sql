-- The dashboard's sample browser (staleflow_db/protocol/samples.py): a run's samples filtered
-- and paged, and one sample with its segments, events and commands.
--
-- A sample's status, as the browser names it: `dropped` (the sample aborted, or its group
-- filtered or aborted), `trained` (rewarded, its group consumed by a step), `rewarded`
-- (rewarded, waiting in a buffer to train) and `in_flight` (queued, running, finished or
-- being scored). Its step is the buffer its group occupies (or trained in); its staleness is
-- that step minus V_traj.

-- name: sample_browse
-- A page of a run's samples, newest first, with id < :before (keyset on the primary key: a page
-- costs the same at any depth, no OFFSET), looking at no more than the :scan newest of them (a
-- filter that matches few samples does not read the whole run in one request: the caller
-- continues below the window, `sample_window`). Every filter is optional (NULL: any);
-- :statuses is an array of the statuses above.
SELECT b.* FROM (
  SELECT s.id AS sample_id, s.group_id, s.idx, s.state::text AS state, g.state::text AS group_state,
    CASE WHEN s.state = 'aborted' OR g.state IN ('filtered', 'aborted') THEN 'dropped'
         WHEN s.state = 'rewarded' AND g.state = 'consumed' THEN 'trained'
         WHEN s.state = 'rewarded' THEN 'rewarded'
         ELSE 'in_flight' END AS status,
    coalesce(s.reason, g.reason) AS reason, g.buffer AS step, s.v_traj, g.buffer - s.v_traj AS staleness,
    s.reward, s.n_tokens, s.n_segments, s.last_version, s.finish_reason, s.instance_id, s.updated_at
  FROM samples s JOIN prompt_groups g ON g.id = s.group_id
  WHERE s.run_id = :run AND (CAST(:before AS bigint) IS NULL OR s.id < CAST(:before AS bigint))
  ORDER BY s.id DESC LIMIT :scan
) b
WHERE (CAST(:statuses AS text[]) IS NULL OR b.status = ANY(CAST(:statuses AS text[])))
  AND (CAST(:step AS int) IS NULL OR b.step = CAST(:step AS int))
  AND (CAST(:reward_min AS float8) IS NULL OR b.reward >= CAST(:reward_min AS float8))
  AND (CAST(:reward_max AS float8) IS NULL OR b.reward <= CAST(:reward_max AS float8))
  AND (CAST(:staleness_min AS int) IS NULL OR b.staleness >= CAST(:staleness_min AS int))
  AND (CAST(:staleness_max AS int) IS NULL OR b.staleness <= CAST(:staleness_max AS int))
  AND (CAST(:length_min AS int) IS NULL OR b.n_tokens >= CAST(:length_min AS int))
  AND (CAST(:length_max AS int) IS NULL OR b.n_tokens <= CAST(:length_max AS int))
ORDER BY b.sample_id DESC LIMIT :n

-- name: sample_window
-- How many samples `sample_browse`'s window held (at most :scan) and the oldest of them: where
-- the next page starts when fewer than a page matched in a full window.
SELECT count(*) AS scanned, min(w.id) AS oldest FROM (
  SELECT s.id FROM samples s
  WHERE s.run_id = :run AND (CAST(:before AS bigint) IS NULL OR s.id < CAST(:before AS bigint))
  ORDER BY s.id DESC LIMIT :scan
) w

-- name: sample_one
-- One sample of a run with its prompt, status, step, staleness, reward and the token that
-- posted the reward (NULL when none, or the token was deleted).
SELECT s.id AS sample_id, s.group_id, s.idx, s.state::text AS state, g.state::text AS group_state,
  CASE WHEN s.state = 'aborted' OR g.state IN ('filtered', 'aborted') THEN 'dropped'
       WHEN s.state = 'rewarded' AND g.state = 'consumed' THEN 'trained'
       WHEN s.state = 'rewarded' THEN 'rewarded'
       ELSE 'in_flight' END AS status,
  s.reason, g.reason AS group_reason, g.client_key, g.prompt_tokens, g.meta, g.buffer AS step,
  s.v_traj, g.buffer - s.v_traj AS staleness, s.attempt, s.instance_id, s.n_tokens, s.n_segments,
  s.last_version, s.finish_reason, s.reward, s.reward_metrics, s.reward_attempt,
  s.reward_token_id AS scorer_token_id, t.name AS scorer_name, t.role::text AS scorer_role,
  g.created_at AS enqueued_at, g.finished_at AS group_finished_at, s.updated_at
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
LEFT JOIN api_tokens t ON t.id = s.reward_token_id
WHERE s.run_id = :run AND s.id = :sample

-- name: sample_segments
-- A sample's segments in order, each with the name of the instance that reported it; its packed
-- token ids, or where the payload store holds them (payload_objects, NULL token_ids).
SELECT x.seq, x.generated, x.version, x.instance_id, i.name AS instance_name, x.attempt,
  x.token_ids, x.n_tokens, x.finish_reason, x.created_at,
  o.url AS object_url, o.size_bytes AS object_size, o.sha256 AS object_sha256, x.payload_offset
FROM segments x LEFT JOIN instances i ON i.id = x.instance_id
LEFT JOIN payload_objects o ON o.id = x.payload_object
WHERE x.sample_id = :sample ORDER BY x.seq

-- name: sample_events
-- The events of a sample and of its group, and the publish of the step it trained in (:step
-- NULL: none), oldest first (a fold's events share its id: `ord` orders them).
SELECT e.id, e.at, e.kind, e.sample_id, e.group_id, e.buffer, e.instance_id, i.name AS instance_name, e.data
FROM events e LEFT JOIN instances i ON i.id = e.instance_id
WHERE e.run_id = :run AND (e.sample_id = :sample OR e.group_id = :group
  OR (e.kind = 'published' AND e.buffer = CAST(:step AS int)))
ORDER BY e.id, e.ord

-- name: sample_commands
-- The coordinator's commands about a sample (interrupts, aborts, pulls), oldest first.
SELECT c.id, c.kind::text AS kind, c.instance_id, i.name AS instance_name, c.attempt, c.target_version,
  c.state::text AS state, c.created_at, c.delivered_at
FROM commands c LEFT JOIN instances i ON i.id = c.instance_id
WHERE c.run_id = :run AND c.sample_id = :sample ORDER BY c.id
