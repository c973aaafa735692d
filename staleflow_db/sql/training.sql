-- Trainer side of the protocol (staleflow_db/protocol/training.py): Consume, publish and the
-- run status (read by protocol/reads.py).

-- name: consume_waiting
-- Whether the trainer is still waiting for buffer :v (answered without the run lock); a
-- cancelled run is not waited for (the locked path refuses it).
SELECT r.version = :v AND r.state <> 'cancelled' AND coalesce(b.occupied < b.batch_size, true) FROM runs r
LEFT JOIN buffers b ON b.run_id = r.id AND b.idx = :v WHERE r.id = :run

-- name: consume_fence
-- A new consume fence for the ready buffer :v: a publish must quote it, an earlier one is fenced.
UPDATE buffers SET consume_fence = consume_fence + 1, consume_fence_at = now()
WHERE run_id = :run AND idx = :v AND occupied >= batch_size RETURNING consume_fence

-- name: consume_groups
SELECT id, group_version, prompt_tokens, meta FROM prompt_groups
WHERE run_id = :run AND state = 'occupied' AND buffer = :v ORDER BY id

-- name: consume_group_placements
-- Each group's Occupy events (the trained-once check: exactly one, naming this buffer), by
-- ix_events_group_occupied
SELECT group_id, buffer FROM events
WHERE run_id = :run AND kind = 'group_occupied' AND group_id = ANY(CAST(:g AS bigint[])) ORDER BY id

-- name: consume_segments
SELECT x.sample_id, x.seq, x.version, x.instance_id, x.token_ids, x.logprobs, x.n_tokens, x.generated
FROM segments x JOIN samples s ON s.id = x.sample_id
WHERE s.group_id = ANY(CAST(:g AS bigint[])) AND s.state = 'rewarded' ORDER BY x.sample_id, x.seq

-- name: consume_samples
SELECT id, group_id, idx, v_traj, reward, finish_reason FROM samples
WHERE group_id = ANY(CAST(:g AS bigint[])) AND state = 'rewarded' ORDER BY group_id, idx

-- name: publish_buffer
SELECT consume_fence, occupied, batch_size FROM buffers WHERE run_id = :run AND idx = :v

-- name: publish_consume_buffer
UPDATE buffers SET consumed_at = now() WHERE run_id = :run AND idx = :v

-- name: publish_consume_groups
UPDATE prompt_groups SET state = 'consumed', finished_at = now()
WHERE run_id = :run AND state = 'occupied' AND buffer = :v

-- name: publish_version
UPDATE runs SET version = version + 1 WHERE id = :run

-- name: publish_params
INSERT INTO param_versions (run_id, version, size_bytes, checksum, location, train_metrics)
VALUES (:run, :v, :size, :sum, :loc, CAST(:metrics AS jsonb))

-- name: publish_replay
-- The consume fence and checksum that published version :v + 1 (a retried publish must match them).
SELECT b.consume_fence, p.checksum FROM buffers b LEFT JOIN param_versions p
ON p.run_id = b.run_id AND p.version = b.idx + 1 WHERE b.run_id = :run AND b.idx = :v

-- name: read_only_snapshot
-- The first statement of a read-only transaction that reads several statements' worth from
-- one snapshot (status, the audit, the dashboard).
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY

-- name: status_samples
SELECT state::text, count(*) FROM samples WHERE run_id = :run GROUP BY 1

-- name: status_groups
SELECT state::text, count(*) FROM prompt_groups WHERE run_id = :run GROUP BY 1

-- name: status_queued
SELECT v_traj, count(*) FROM samples WHERE run_id = :run AND state = 'queued'
GROUP BY v_traj ORDER BY v_traj NULLS LAST

-- name: status_instances
SELECT count(*) FROM instances WHERE run_id = :run AND state = 'active'
