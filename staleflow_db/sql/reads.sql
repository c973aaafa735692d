-- Reads outside the protocol transitions (staleflow_db/protocol/reads.py): run lists,
-- parameter versions, instance owners, the audit views, the /metrics figures and the
-- dashboard's panels.

-- name: list_runs
-- Runs by id; only :run when it is not null.
SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p, name, created_at, state_reason FROM runs
WHERE (CAST(:run AS bigint) IS NULL OR id = :run) ORDER BY id LIMIT :n OFFSET :o

-- name: run_by_name
-- A run's id by its name (names are unique; REST paths and the clients name runs by either).
SELECT id FROM runs WHERE name = :name

-- name: get_run
SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p, name, created_at, state_reason FROM runs WHERE id = :run

-- name: param_versions
SELECT version, size_bytes, checksum, location, created_at, train_metrics FROM param_versions
WHERE run_id = :run ORDER BY version DESC LIMIT :n

-- name: instance_owner
SELECT run_id, token_id FROM instances WHERE id = :i

-- name: audit_trained
SELECT * FROM trained_samples ORDER BY run_id, step, sample_id LIMIT :n OFFSET :o

-- name: audit_trained_of_run
-- A run's rows only: `run_id = :run` is pushed down into the view.
SELECT * FROM trained_samples WHERE run_id = :run ORDER BY run_id, step, sample_id LIMIT :n OFFSET :o

-- name: audit_dropped
SELECT * FROM dropped_samples ORDER BY run_id, sample_id LIMIT :n OFFSET :o

-- name: audit_dropped_of_run
SELECT * FROM dropped_samples WHERE run_id = :run ORDER BY run_id, sample_id LIMIT :n OFFSET :o

-- name: audit_violations
SELECT * FROM staleness_violations ORDER BY run_id, invariant, subject LIMIT :n OFFSET :o

-- name: audit_violations_of_run
SELECT * FROM staleness_violations WHERE run_id = :run ORDER BY run_id, invariant, subject LIMIT :n OFFSET :o

-- name: schema_revision
SELECT version_num FROM alembic_version

-- name: ping
-- A connection's liveness (the API's database probe).
SELECT 1

-- name: read_only
SET TRANSACTION READ ONLY

-- name: metrics_runs
SELECT id, version, state, batch_size, buffer_capacity, group_size, samples_per_group, eta,
  max_response_tokens, max_prompt_tokens, dapo_filter, temperature, top_p FROM runs ORDER BY id DESC LIMIT :n

-- name: metrics_queued
SELECT run_id, v_traj, count(*) AS n FROM samples WHERE state = 'queued'
AND run_id = ANY(CAST(:ids AS bigint[])) GROUP BY 1, 2

-- name: metrics_buffers
SELECT b.run_id, b.idx, b.occupied, b.reserved, b.consumed_at IS NOT NULL AS consumed FROM buffers b
JOIN runs r ON r.id = b.run_id WHERE b.run_id = ANY(CAST(:ids AS bigint[])) AND b.idx >= r.version

-- name: metrics_staleness
SELECT s.run_id, g.buffer - s.v_traj AS staleness, count(*) AS n
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE g.state = 'consumed' AND s.state = 'rewarded' AND s.run_id = ANY(CAST(:ids AS bigint[]))
GROUP BY 1, 2

-- name: metrics_instances
SELECT run_id, CASE WHEN state = 'active' AND lease_expires_at < now() THEN 'lapsed'
ELSE state::text END AS state, count(*) AS n FROM instances
WHERE run_id = ANY(CAST(:ids AS bigint[])) GROUP BY 1, 2

-- name: metrics_dropped
-- Groups only: aborted samples have no index, and counting them scanned all samples (a
-- tenfold slower scrape on a backlog); the audit has them one by one.
SELECT run_id, reason, count(*) AS n FROM prompt_groups WHERE state IN ('filtered', 'aborted')
AND run_id = ANY(CAST(:ids AS bigint[])) GROUP BY 1, 2

-- name: metrics_cycles
-- The newest :recent cycles only (an index range per run): sums over the whole history
-- would grow with the run, about a million rows a day at 10 cycles/s.
SELECT r.id AS run_id, w.* FROM unnest(CAST(:ids AS bigint[])) AS r(id) CROSS JOIN LATERAL
(SELECT count(*) AS n, extract(epoch FROM max(at)) AS last_at,
extract(epoch FROM max(at) - min(at)) AS span_s,
avg(snapshot_ms) AS snapshot_ms, avg(decide_ms) AS decide_ms, avg(write_ms) AS write_ms,
max(snapshot_ms) AS max_snapshot_ms, max(decide_ms) AS max_decide_ms,
max(write_ms) AS max_write_ms, (array_agg(snapshot_ms ORDER BY id DESC))[1] AS last_snapshot_ms,
(array_agg(decide_ms ORDER BY id DESC))[1] AS last_decide_ms,
(array_agg(write_ms ORDER BY id DESC))[1] AS last_write_ms,
avg(routed) AS routed, avg(interrupted) AS interrupted, avg(pulled) AS pulled,
avg(migrated) AS migrated FROM (SELECT * FROM coordinator_cycles c WHERE c.run_id = r.id
ORDER BY c.id DESC LIMIT :recent) x) w WHERE w.n > 0

-- name: metrics_lock_waits
SELECT locktype, count(*) AS n FROM pg_locks WHERE NOT granted
AND (database IS NULL OR database = (SELECT oid FROM pg_database
WHERE datname = current_database())) GROUP BY 1

-- name: dashboard_run
SELECT name, created_at FROM runs WHERE id = :run

-- The dashboard's panels (api/routers/ui.py): `panel_<panel>_<rows>`, each bound to :run and
-- :n (the steps asked for).

-- name: panel_steps_steps
-- A step is a consumed buffer: its trained samples' rewards and response tokens, and the
-- time since the step before (the first step counts from the run's creation). Newest first,
-- for LIMIT.
WITH t AS (SELECT g.buffer AS step, avg(s.reward) AS reward_mean,
coalesce(stddev_pop(s.reward), 0) AS reward_std, min(s.reward) AS reward_min,
max(s.reward) AS reward_max, sum(s.n_tokens) AS tokens, count(*) AS samples
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE s.run_id = :run AND g.state = 'consumed' AND s.state = 'rewarded' GROUP BY 1),
b AS (SELECT b.idx AS step, b.consumed_at, CAST(extract(epoch FROM b.consumed_at - coalesce(
 lag(b.consumed_at) OVER (ORDER BY b.idx), r.created_at)) AS float8) AS step_s
 FROM buffers b JOIN runs r ON r.id = b.run_id WHERE b.run_id = :run AND b.consumed_at IS NOT NULL)
SELECT b.step, b.consumed_at, b.step_s, t.reward_mean, t.reward_std, t.reward_min, t.reward_max,
t.tokens, t.samples, t.tokens / nullif(b.step_s, 0) AS tokens_per_s
FROM b LEFT JOIN t USING (step) ORDER BY b.step DESC LIMIT :n

-- name: panel_steps_reward_metrics
-- The mean of each reward metric (samples.reward_metrics) over a step's trained samples that
-- reported it, for the latest :n steps.
SELECT g.buffer AS step, m.key AS metric, avg(CAST(m.value AS float8)) AS mean, count(*) AS n
FROM samples s JOIN prompt_groups g ON g.id = s.group_id CROSS JOIN LATERAL jsonb_each(s.reward_metrics) AS m
WHERE s.run_id = :run AND g.state = 'consumed' AND s.state = 'rewarded' AND s.reward_metrics IS NOT NULL
AND g.buffer > (SELECT version FROM runs WHERE id = :run) - 1 - :n GROUP BY 1, 2 ORDER BY 1, 2

-- name: panel_steps_instance_versions
-- Which version each instance was on: its registration and the pulls it was told to do.
SELECT instance_id, at,
CAST(coalesce(data->>'version', data->>'target') AS integer) AS version
FROM events WHERE run_id = :run AND kind IN ('instance_registered', 'pull') ORDER BY id

-- name: panel_staleness_histogram
SELECT g.buffer AS step, g.buffer - s.v_traj AS staleness, count(*) AS n
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE s.run_id = :run AND g.state = 'consumed' AND s.state = 'rewarded'
AND g.buffer > (SELECT version FROM runs WHERE id = :run) - 1 - :n GROUP BY 1, 2 ORDER BY 1, 2

-- name: panel_staleness_buffers
SELECT b.idx, b.batch_size, b.capacity, b.occupied, b.reserved
FROM buffers b JOIN runs r ON r.id = b.run_id
WHERE b.run_id = :run AND b.consumed_at IS NULL ORDER BY b.idx

-- name: panel_instances_instances
SELECT i.id, i.name, i.version, i.snapshot,
CAST(extract(epoch FROM now() - coalesce(i.snapshot_at, i.created_at)) AS float8) AS heartbeat_age_s,
CAST(extract(epoch FROM i.lease_expires_at - now()) AS float8) AS lease_left_s,
(SELECT count(*) FROM samples s WHERE s.instance_id = i.id AND s.state = 'running') AS routed
FROM instances i WHERE i.run_id = :run AND i.state = 'active' ORDER BY i.id

-- name: panel_queue_levels
-- The level of a queued sample is its V_traj (null: fresh, not generated yet).
SELECT v_traj AS level, count(*) AS n FROM samples WHERE run_id = :run AND state = 'queued'
GROUP BY 1 ORDER BY 1 NULLS FIRST

-- name: panel_queue_samples
SELECT state::text AS state, count(*) AS n FROM samples WHERE run_id = :run GROUP BY 1

-- name: panel_coordinator_cycles
SELECT id, epoch, at, snapshot_ms, decide_ms, write_ms, routed, interrupted, pulled, migrated
FROM coordinator_cycles WHERE run_id = :run ORDER BY id DESC LIMIT :n

-- name: panel_coordinator_commands
SELECT id, instance_id, kind::text AS kind, sample_id, target_version, state::text AS state,
created_at FROM commands WHERE run_id = :run ORDER BY id DESC LIMIT 20

-- name: panel_drops_reasons
SELECT reason, count(*) AS n FROM samples WHERE run_id = :run AND state = 'aborted'
GROUP BY 1 ORDER BY 2 DESC

-- name: panel_audit_violations
SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :run
ORDER BY invariant, subject LIMIT 50

-- name: lineage_of_step
-- `trained_lineage` of one trained step (:sample NULL: every sample of it), in sample, seq order.
SELECT step, sample_id, group_id, idx, v_traj, staleness, seq, generated, version, instance_id,
  instance_name, attempt, n_tokens, finish_reason, segment_at, checksum, location, published_at,
  published_by_step, reward, reward_metrics, reward_attempt, scorer_token_id, scorer_name, scorer_role
FROM trained_lineage WHERE run_id = :run AND step = :step
  AND (CAST(:sample AS bigint) IS NULL OR sample_id = CAST(:sample AS bigint))
ORDER BY sample_id, seq

-- name: export_samples
-- A page of a run's rollouts for `staleflow export`, by sample id after :after (keyset: the
-- primary key, so a page costs the same at any depth); :trained only those trained. Per
-- segment in seq order: its length, version (NULL for an observation), instance, whether it
-- was generated, and its packed token ids and log-probs, or (NULL there) the payload store's
-- object, size, SHA-256 and offset that hold them (`ProtocolReads.export_page` reads those
-- through the store and makes per-token lists: tokens, log-probs, loss mask, versions).
SELECT s.id AS sample_id, s.group_id, s.idx, g.client_key, g.prompt_tokens,
  s.state::text AS state, s.reason, g.state::text AS group_state,
  CASE WHEN g.state = 'consumed' AND s.state = 'rewarded' THEN g.buffer END AS step,
  s.v_traj,
  CASE WHEN g.state = 'consumed' AND s.state = 'rewarded' THEN g.buffer - s.v_traj END AS staleness,
  s.reward, s.reward_metrics, s.reward_token_id, s.finish_reason, s.n_tokens,
  coalesce(sg.lengths, '{}') AS seg_lengths, coalesce(sg.versions, '{}') AS seg_versions,
  coalesce(sg.instances, '{}') AS seg_instances, coalesce(sg.generated, '{}') AS seg_generated,
  coalesce(sg.tokens, '{}') AS seg_tokens, coalesce(sg.logprobs, '{}') AS seg_logprobs,
  coalesce(sg.urls, '{}') AS seg_urls, coalesce(sg.sizes, '{}') AS seg_sizes, coalesce(sg.sums, '{}') AS seg_sums,
  coalesce(sg.offsets, '{}') AS seg_offsets,
  g.created_at AS enqueued_at, sg.first_at AS first_segment_at, sg.last_at AS last_segment_at,
  g.finished_at AS group_finished_at, s.updated_at
FROM samples s
JOIN prompt_groups g ON g.id = s.group_id
LEFT JOIN LATERAL (
  SELECT array_agg(x.n_tokens ORDER BY x.seq) AS lengths,
         array_agg(x.version ORDER BY x.seq) AS versions, array_agg(x.instance_id ORDER BY x.seq) AS instances,
         array_agg(x.generated ORDER BY x.seq) AS generated,
         array_agg(x.token_ids ORDER BY x.seq) AS tokens, array_agg(x.logprobs ORDER BY x.seq) AS logprobs,
         array_agg(o.url ORDER BY x.seq) AS urls, array_agg(o.size_bytes ORDER BY x.seq) AS sizes,
         array_agg(o.sha256 ORDER BY x.seq) AS sums, array_agg(x.payload_offset ORDER BY x.seq) AS offsets,
         min(x.created_at) AS first_at, max(x.created_at) AS last_at
  FROM segments x LEFT JOIN payload_objects o ON o.id = x.payload_object WHERE x.sample_id = s.id) sg ON true
WHERE s.run_id = :run AND s.id > :after
  AND (NOT :trained OR (s.state = 'rewarded' AND g.state = 'consumed'))
ORDER BY s.id LIMIT :n

-- name: export_count
-- How many samples `export_samples` pages through (the progress bar's total).
SELECT count(*) FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE s.run_id = :run AND (NOT :trained OR (s.state = 'rewarded' AND g.state = 'consumed'))
