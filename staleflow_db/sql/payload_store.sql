-- The payload store (staleflow_db/payload_store.py): finished segments' payloads moved into
-- objects, the rows keeping the metadata and an object reference.

-- name: offload_candidates
-- Up to :n resident payloads of the run's finished segments (sample aborted, or group consumed:
-- trained), by ix_segments_resident, in (sample, seq) order, locked (SKIP LOCKED: a concurrent
-- offload takes others), cut after about :max_bytes of payload.
WITH c AS MATERIALIZED (
  SELECT x.sample_id, x.seq, x.token_ids, x.logprobs, x.n_tokens FROM segments x
  JOIN samples s ON s.id = x.sample_id JOIN prompt_groups g ON g.id = s.group_id
  WHERE x.run_id = :run AND x.token_ids IS NOT NULL AND (s.state = 'aborted' OR g.state = 'consumed')
  ORDER BY x.sample_id, x.seq LIMIT :n FOR UPDATE OF x SKIP LOCKED)
SELECT sample_id, seq, token_ids, logprobs FROM (
  SELECT c.*, sum(8 * n_tokens) OVER (ORDER BY sample_id, seq) - 8 * n_tokens AS before FROM c) w
WHERE before < :max_bytes ORDER BY sample_id, seq

-- name: offload_record
-- The object just written, and its segments pointed at it (their payloads NULL: the one update
-- the segments' trigger allows).
WITH o AS (INSERT INTO payload_objects (run_id, url, size_bytes, sha256) VALUES (:run, :url, :size, :sha) RETURNING id)
UPDATE segments x SET token_ids = NULL, logprobs = NULL, payload_object = (SELECT id FROM o), payload_offset = u.off
FROM unnest(CAST(:sids AS bigint[]), CAST(:seqs AS int[]), CAST(:offs AS bigint[])) AS u(s, q, off)
WHERE x.sample_id = u.s AND x.seq = u.q AND x.token_ids IS NOT NULL

-- name: audit_offloaded_segments
-- The run's offloaded segments with their objects, object by object (the audit reads each once).
SELECT x.sample_id, x.seq, x.n_tokens, x.generated, x.payload_offset, o.id AS object_id, o.url, o.size_bytes, o.sha256
FROM segments x JOIN payload_objects o ON o.id = x.payload_object
WHERE x.run_id = :r ORDER BY o.id, x.payload_offset
