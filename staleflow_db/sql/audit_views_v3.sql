-- The audit views as migration 0014 applied them (frozen: never edit). 0014 applies these,
-- and 0015's downgrade restores them; audit.sql holds the current definitions (0015 reads the
-- packed payloads: segments.n_tokens, bytea log-probs).

-- name: view_trained_samples
-- Every trained sample: its step (the buffer its group was consumed from), staleness, and
-- the version and instance of each of its segments.
CREATE OR REPLACE VIEW trained_samples AS
SELECT s.run_id,
       g.buffer AS step,
       s.id AS sample_id,
       s.group_id,
       s.idx,
       s.v_traj,
       g.buffer - s.v_traj AS staleness,
       g.group_version,
       g.buffer - g.group_version AS group_staleness,
       seg.versions AS segment_versions,
       seg.instances AS segment_instances,
       coalesce(cardinality(seg.versions), 0) AS n_segments,
       s.n_tokens,
       s.reward,
       s.finish_reason
FROM samples s
JOIN prompt_groups g ON g.id = s.group_id AND g.state = 'consumed'
LEFT JOIN LATERAL (
    SELECT array_agg(x.version ORDER BY x.seq) AS versions,
           array_agg(x.instance_id ORDER BY x.seq) AS instances
    FROM segments x WHERE x.sample_id = s.id
) seg ON true
WHERE s.state = 'rewarded'

-- name: view_dropped_samples
-- Every aborted sample, with why and what its group became.
CREATE OR REPLACE VIEW dropped_samples AS
SELECT s.run_id, s.id AS sample_id, s.group_id, s.idx, s.reason, g.state AS group_state,
       s.v_traj, s.n_tokens, s.n_segments, s.updated_at AS dropped_at
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE s.state = 'aborted'

-- name: view_staleness_violations_v2
-- One row per broken invariant of docs/protocol.md and of conservation, as (run_id,
-- invariant, subject, detail). Empty in a healthy run, also between any two protocol
-- transactions. Migration 0002 created it as `staleness_violations` from its frozen copy
-- audit_v2.sql; 0007 renamed it, and `staleness_violations` is it plus the lineage checks.
--
-- Written from the spec, not from the protocol code. Every branch exposes run_id straight
-- from a base table (or as a GROUP BY / PARTITION BY column), so `WHERE run_id = X` is
-- pushed down into every branch and each branch is one linear pass over that run's rows;
-- no CTE (a CTE used twice is materialised for every run), no subquery per row scanned (the
-- one scalar subquery builds the detail of a reported row, by primary key).
--
-- invariant names (docs/data-layer.md, "Audit views", explains each):
--   bound, group_version, capacity, entry_buffer, reservation_window, consumed_batch,
--   trained_state, contiguity, horizon, segment_version, tokens, trained_members,
--   live_member, unreserved_member, dead_instance, drop_reason, conservation
CREATE OR REPLACE VIEW staleness_violations_v2 AS
-- bound (group): a group placed in buffer b satisfies V_group <= b <= V_group + eta
SELECT g.run_id, 'bound' AS invariant, 'group ' || g.id AS subject,
       format('group version %s in buffer %s with eta %s', g.group_version, g.buffer, r.eta) AS detail
FROM prompt_groups g JOIN runs r ON r.id = g.run_id
WHERE g.state IN ('occupied', 'consumed')
  AND (g.group_version IS NULL OR g.buffer IS NULL OR NOT (g.buffer BETWEEN g.group_version AND g.group_version + r.eta))

-- bound (sample): every member placed with its group (trained or waiting to be) lies inside
-- the window too: b - eta <= V_traj <= b
UNION ALL
SELECT s.run_id, 'bound', 'sample ' || s.id,
       format('V_traj %s in buffer %s (%s group %s) with eta %s', s.v_traj, g.buffer, g.state, g.id, r.eta)
FROM samples s
JOIN prompt_groups g ON g.id = s.group_id AND g.run_id = s.run_id AND g.state IN ('occupied', 'consumed')
JOIN runs r ON r.id = s.run_id
WHERE s.state = 'rewarded' AND (s.v_traj IS NULL OR NOT (g.buffer BETWEEN s.v_traj AND s.v_traj + r.eta))

-- group_version: a placed group's version is min(V_traj) of its trained members;
-- trained_members: a placed group has exactly N trained (rewarded) members
UNION ALL
SELECT g.run_id, k.invariant, 'group ' || g.id,
       CASE k.invariant
           WHEN 'group_version' THEN format('recorded version %s, min V_traj of its trained members %s', g.group_version, m.v)
           ELSE format('%s group with %s trained members, N = %s', g.state, coalesce(m.n, 0), r.group_size)
       END
FROM prompt_groups g
JOIN runs r ON r.id = g.run_id
LEFT JOIN (SELECT run_id, group_id, count(*) AS n, min(v_traj) AS v
           FROM samples WHERE state = 'rewarded' GROUP BY run_id, group_id) m
       ON m.run_id = g.run_id AND m.group_id = g.id
CROSS JOIN LATERAL (VALUES
    ('group_version', m.n > 0 AND g.group_version IS DISTINCT FROM m.v),
    ('trained_members', coalesce(m.n, 0) <> r.group_size)
) AS k(invariant, broken)
WHERE g.state IN ('occupied', 'consumed') AND k.broken

-- capacity: per buffer, the counters agree with the entries (groups naming the buffer),
-- occupied + reserved <= B', occupied <= B, and the buffer carries the run's B and B'
UNION ALL
SELECT b.run_id, 'capacity', 'buffer ' || b.idx,
       format('counters occupied %s reserved %s; entries occupied %s reserved %s; capacity %s (run %s), B %s (run %s)',
              b.occupied, b.reserved, coalesce(o.n, 0), coalesce(rs.n, 0),
              b.capacity, r.buffer_capacity, b.batch_size, r.batch_size)
FROM buffers b
JOIN runs r ON r.id = b.run_id
LEFT JOIN (SELECT run_id, buffer AS idx, count(*) AS n FROM prompt_groups
           WHERE state IN ('occupied', 'consumed') GROUP BY run_id, buffer) o
       ON o.run_id = b.run_id AND o.idx = b.idx
LEFT JOIN (SELECT run_id, reserved_buffer AS idx, count(*) AS n FROM prompt_groups
           WHERE state = 'reserved' GROUP BY run_id, reserved_buffer) rs
       ON rs.run_id = b.run_id AND rs.idx = b.idx
WHERE b.occupied <> coalesce(o.n, 0) OR b.reserved <> coalesce(rs.n, 0)
   OR b.occupied + b.reserved > b.capacity OR b.occupied > b.batch_size
   OR coalesce(o.n, 0) + coalesce(rs.n, 0) > r.buffer_capacity OR coalesce(o.n, 0) > r.batch_size
   OR b.capacity <> r.buffer_capacity OR b.batch_size <> r.batch_size

-- entry_buffer: every entry names a buffer that exists, and no entry is still RESERVED in a
-- consumed buffer (publish moves such reservations on or drops them)
UNION ALL
SELECT g.run_id, 'entry_buffer', 'group ' || g.id,
       format('%s entry in buffer %s, which %s', g.state,
              CASE WHEN g.state = 'reserved' THEN g.reserved_buffer ELSE g.buffer END,
              CASE WHEN b.idx IS NULL THEN 'does not exist' ELSE 'is consumed' END)
FROM prompt_groups g
LEFT JOIN buffers b ON b.run_id = g.run_id
                   AND b.idx = CASE WHEN g.state = 'reserved' THEN g.reserved_buffer ELSE g.buffer END
WHERE g.state IN ('reserved', 'occupied', 'consumed')
  AND (b.idx IS NULL OR (g.state = 'reserved' AND b.consumed_at IS NOT NULL))

-- reservation_window: the join rule. A member whose V_traj is fixed (routed, or holding
-- tokens) keeps its group's reserved buffer inside its window: b_g <= V_traj + eta
UNION ALL
SELECT s.run_id, 'reservation_window', 'sample ' || s.id,
       format('V_traj %s (%s) but its group %s is reserved in buffer %s with eta %s',
              s.v_traj, s.state, g.id, g.reserved_buffer, r.eta)
FROM samples s
JOIN prompt_groups g ON g.id = s.group_id AND g.run_id = s.run_id AND g.state = 'reserved'
JOIN runs r ON r.id = s.run_id
WHERE (s.state IN ('running', 'finished', 'scoring', 'rewarded') OR (s.state = 'queued' AND s.n_tokens > 0))
  AND (s.v_traj IS NULL OR g.reserved_buffer > s.v_traj + r.eta)

-- consumed_batch: a consumed buffer was trained on exactly B occupied groups
UNION ALL
SELECT b.run_id, 'consumed_batch', 'buffer ' || b.idx,
       format('consumed with %s groups, B = %s', coalesce(o.n, 0), r.batch_size)
FROM buffers b
JOIN runs r ON r.id = b.run_id
LEFT JOIN (SELECT run_id, buffer AS idx, count(*) AS n FROM prompt_groups
           WHERE state IN ('occupied', 'consumed') GROUP BY run_id, buffer) o
       ON o.run_id = b.run_id AND o.idx = b.idx
WHERE b.consumed_at IS NOT NULL AND coalesce(o.n, 0) <> r.batch_size

-- trained_state: a group is consumed exactly when its buffer is (an occupied group in a
-- consumed buffer was never trained; a consumed one in a live buffer was never published)
UNION ALL
SELECT g.run_id, 'trained_state', 'group ' || g.id,
       format('%s in buffer %s, which is %s', g.state, g.buffer,
              CASE WHEN b.consumed_at IS NULL THEN 'not consumed' ELSE 'consumed' END)
FROM prompt_groups g
JOIN buffers b ON b.run_id = g.run_id AND b.idx = g.buffer
WHERE (g.state = 'occupied' AND b.consumed_at IS NOT NULL) OR (g.state = 'consumed' AND b.consumed_at IS NULL)

-- contiguity (run): the consumed buffers are exactly 0 .. version-1
UNION ALL
SELECT r.id, 'contiguity', 'run ' || r.id,
       format('version %s but %s consumed buffers (lowest %s, highest %s)', r.version, coalesce(c.n, 0), c.lo, c.hi)
FROM runs r
LEFT JOIN (SELECT run_id, count(*) AS n, min(idx) AS lo, max(idx) AS hi FROM buffers
           WHERE consumed_at IS NOT NULL GROUP BY run_id) c ON c.run_id = r.id
WHERE coalesce(c.n, 0) <> r.version OR coalesce(c.lo, 0) <> 0 OR coalesce(c.hi, -1) <> r.version - 1

-- contiguity (buffer): each consumed buffer b was published exactly once (one `published`
-- event, parameter version b+1 recorded); a buffer not consumed was never published
UNION ALL
SELECT b.run_id, 'contiguity', 'buffer ' || b.idx,
       format('consumed %s, %s published events, parameter version %s recorded %s',
              b.consumed_at IS NOT NULL, coalesce(e.n, 0), b.idx + 1, pv.version IS NOT NULL)
FROM buffers b
LEFT JOIN (SELECT run_id, buffer AS idx, count(*) AS n FROM events
           WHERE kind = 'published' GROUP BY run_id, buffer) e
       ON e.run_id = b.run_id AND e.idx = b.idx
LEFT JOIN param_versions pv ON pv.run_id = b.run_id AND pv.version = b.idx + 1
WHERE coalesce(e.n, 0) <> (b.consumed_at IS NOT NULL)::int
   OR (pv.version IS NOT NULL) <> (b.consumed_at IS NOT NULL)

-- contiguity (publication without a buffer): a published event or a parameter version
-- (>= 1: version 0 is the initial model) whose buffer does not exist
UNION ALL
SELECT e.run_id, 'contiguity', format('buffer %s', e.buffer), 'published, but there is no such buffer'
FROM events e
WHERE e.kind = 'published'
  AND NOT EXISTS (SELECT 1 FROM buffers b WHERE b.run_id = e.run_id AND b.idx = e.buffer)
UNION ALL
SELECT pv.run_id, 'contiguity', 'version ' || pv.version,
       format('parameter version %s recorded, but buffer %s does not exist', pv.version, pv.version - 1)
FROM param_versions pv
WHERE pv.version >= 1
  AND NOT EXISTS (SELECT 1 FROM buffers b WHERE b.run_id = pv.run_id AND b.idx = pv.version - 1)

-- horizon: at most eta+1 unconsumed buffers exist, so none lies beyond version + eta
UNION ALL
SELECT b.run_id, 'horizon', 'buffer ' || b.idx,
       format('buffer %s exists at version %s with eta %s', b.idx, r.version, r.eta)
FROM buffers b JOIN runs r ON r.id = b.run_id
WHERE b.idx < 0 OR b.idx > r.version + r.eta

-- segment_version: segment versions start at >= V_traj, never decrease, never exceed the
-- run's version, and never exceed the step that trains (or will train) the sample;
-- tokens: a sample's tokens are the concatenation of its segments 0..k-1 (counts agree)
UNION ALL
SELECT s.run_id, k.invariant, 'sample ' || s.id,
       CASE k.invariant
           -- the version sequence is read (by primary key) only for the rows reported
           WHEN 'segment_version' THEN format('segment versions %s, V_traj %s, run version %s, trained at step %s',
                                              (SELECT array_agg(z.version ORDER BY z.seq) FROM segments z WHERE z.sample_id = s.id),
                                              s.v_traj, r.version, coalesce(g.buffer::text, '-'))
           ELSE format('n_tokens %s but segments hold %s tokens in %s segments (seq %s..%s)',
                       s.n_tokens, coalesce(x.n_tokens, 0), coalesce(x.n, 0), x.first_seq, x.last_seq)
       END
FROM samples s
JOIN runs r ON r.id = s.run_id
LEFT JOIN prompt_groups g ON g.id = s.group_id AND g.run_id = s.run_id AND g.state IN ('occupied', 'consumed') AND s.state = 'rewarded'
LEFT JOIN (  -- narrow rows (no token data) in seq order: versions, and whether any step goes down
    SELECT run_id, sample_id, min(version) AS lo, max(version) AS hi, bool_or(version < prev) AS decreases
    FROM (SELECT run_id, sample_id, seq, version,
                 lag(version) OVER (PARTITION BY run_id, sample_id ORDER BY seq) AS prev
          FROM segments) w
    GROUP BY run_id, sample_id
) v ON v.run_id = s.run_id AND v.sample_id = s.id
LEFT JOIN (  -- token counts
    SELECT run_id, sample_id, count(*) AS n, min(seq) AS first_seq, max(seq) AS last_seq,
           sum(cardinality(token_ids)) AS n_tokens
    FROM segments GROUP BY run_id, sample_id
) x ON x.run_id = s.run_id AND x.sample_id = s.id
CROSS JOIN LATERAL (VALUES
    ('segment_version',
     v.lo IS NOT NULL AND (s.v_traj IS NULL OR v.lo < s.v_traj OR v.decreases OR v.hi > r.version OR v.hi > g.buffer)),
    ('tokens',
     s.n_tokens <> coalesce(x.n_tokens, 0) OR (x.n > 0 AND (x.first_seq <> 0 OR x.last_seq <> x.n - 1)))
) AS k(invariant, broken)
WHERE k.broken

-- live_member: every member of a dropped (filtered/aborted) group is aborted, and every
-- member of a placed (occupied/consumed) group is trained or aborted;
-- unreserved_member: a group still queued (no reservation) has no routed member
UNION ALL
SELECT s.run_id, CASE WHEN g.state = 'queued' THEN 'unreserved_member' ELSE 'live_member' END,
       'sample ' || s.id,
       format('%s member (%s tokens) of %s group %s', s.state, s.n_tokens, g.state, g.id)
FROM samples s JOIN prompt_groups g ON g.id = s.group_id AND g.run_id = s.run_id
WHERE (g.state IN ('filtered', 'aborted') AND s.state <> 'aborted')
   OR (g.state IN ('occupied', 'consumed') AND s.state NOT IN ('rewarded', 'aborted'))
   OR (g.state = 'queued' AND (s.state NOT IN ('queued', 'aborted') OR s.n_tokens > 0))

-- dead_instance: a running sample runs on an existing, active instance of its run (one whose
-- lease lapsed but that no sweep has fenced yet is still active: not flagged)
UNION ALL
SELECT s.run_id, 'dead_instance', 'sample ' || s.id,
       format('running on instance %s, which is %s', s.instance_id,
              CASE WHEN i.id IS NULL THEN 'not an instance of its run' ELSE i.state::text END)
FROM samples s LEFT JOIN instances i ON i.id = s.instance_id AND i.run_id = s.run_id
WHERE s.state = 'running' AND (i.id IS NULL OR i.state <> 'active')

-- drop_reason: every dropped sample and group carries a reason
UNION ALL
SELECT s.run_id, 'drop_reason', 'sample ' || s.id, 'aborted without a reason'
FROM samples s WHERE s.state = 'aborted' AND coalesce(btrim(s.reason), '') = ''
UNION ALL
SELECT g.run_id, 'drop_reason', 'group ' || g.id, format('%s without a reason', g.state)
FROM prompt_groups g WHERE g.state IN ('filtered', 'aborted') AND coalesce(btrim(g.reason), '') = ''

-- conservation (run): every sample ever created is trained (rewarded in a consumed group),
-- dropped (aborted), or in flight: queued, or running on an active instance, in a live
-- (queued/reserved) group; finished or scoring in a live group; rewarded in a live or
-- occupied group. Anything else is lost.
UNION ALL
SELECT f.run_id, 'conservation', 'run ' || f.run_id,
       format('%s samples: %s trained, %s dropped, %s in flight, %s lost (first: %s)',
              count(*), count(*) FILTER (WHERE f.fate = 'trained'), count(*) FILTER (WHERE f.fate = 'dropped'),
              count(*) FILTER (WHERE f.fate = 'in flight'), count(*) FILTER (WHERE f.fate = 'lost'),
              array_to_string((array_agg(f.id ORDER BY f.id) FILTER (WHERE f.fate = 'lost'))[1:5], ', '))
FROM (
    SELECT s.run_id, s.id,
           CASE
               WHEN s.state = 'aborted' THEN 'dropped'
               WHEN s.state = 'rewarded' AND g.state = 'consumed' THEN 'trained'
               WHEN g.state IN ('queued', 'reserved')
                    AND (s.state IN ('queued', 'finished', 'scoring', 'rewarded')
                         OR (s.state = 'running' AND i.state = 'active' AND i.run_id = s.run_id)) THEN 'in flight'
               WHEN g.state = 'occupied' AND s.state = 'rewarded' THEN 'in flight'
               ELSE 'lost'
           END AS fate
    FROM samples s
    LEFT JOIN prompt_groups g ON g.id = s.group_id AND g.run_id = s.run_id
    LEFT JOIN instances i ON i.id = s.instance_id AND i.run_id = s.run_id
) f
GROUP BY f.run_id
HAVING count(*) FILTER (WHERE f.fate = 'lost') > 0

-- conservation (group): a group keeps its N' members 0..N'-1, and a live group can still
-- reach N (fewer live members means it must have been aborted)
UNION ALL
SELECT g.run_id, 'conservation', 'group ' || g.id,
       format('%s group with %s of its %s members (idx %s..%s), %s not aborted, N = %s',
              g.state, coalesce(m.n, 0), r.samples_per_group, m.lo, m.hi, coalesce(m.live, 0), r.group_size)
FROM prompt_groups g
JOIN runs r ON r.id = g.run_id
LEFT JOIN (SELECT run_id, group_id, count(*) AS n, min(idx) AS lo, max(idx) AS hi,
                  count(*) FILTER (WHERE state <> 'aborted') AS live
           FROM samples GROUP BY run_id, group_id) m
       ON m.run_id = g.run_id AND m.group_id = g.id
WHERE coalesce(m.n, 0) <> r.samples_per_group OR m.lo <> 0 OR m.hi <> r.samples_per_group - 1
   OR (g.state IN ('queued', 'reserved') AND coalesce(m.live, 0) < r.group_size)

-- conservation (prompt): a filtered group's prompt was enqueued again (DAPO replacement)
UNION ALL
SELECT g.run_id, 'conservation', 'group ' || g.id, 'filtered without a replacement group'
FROM prompt_groups g
WHERE g.state = 'filtered'
  AND NOT EXISTS (SELECT 1 FROM prompt_groups x WHERE x.run_id = g.run_id AND x.replacement_of = g.id)

-- conservation (prompt): every enqueued group (event log, append-only) still exists
UNION ALL
SELECT e.run_id, 'conservation', 'group ' || e.group_id, 'enqueued (see the event log) but its row is gone'
FROM events e
WHERE e.kind = 'group_enqueued'
  AND NOT EXISTS (SELECT 1 FROM prompt_groups g WHERE g.run_id = e.run_id AND g.id = e.group_id);

-- name: view_lineage_violations
-- The lineage checks of the complete audit, as (run_id, invariant, subject, detail): each
-- compares a row with what it derives from — the append-only history (the event log and the
-- segments) or, for a group's version, its live members. Migration 0007 created it from its
-- frozen copy audit_lineage_v1.sql.
--
-- Written from the spec (docs/protocol.md), not from the protocol code:
--   trained_once     a group is placed once and trained at most once: its row names the buffer
--                    of its one `group_occupied` event, and a group with such an event stays
--                    placed (occupied, then consumed). A trained group swapped with an
--                    untrained one keeps every counter right, but not this.
--   segment_lineage  attempts count routes: route k of a sample is its attempt k (its k-th
--                    `sample_routed` event), a sample's attempt counter is its number of routes,
--                    its segments' attempts never decrease along seq, and a segment of attempt k
--                    came from the instance route k sent it to.
--   segment_count    a sample's counters agree with its segments: n_segments is their number
--                    (the next report writes seq n_segments, so a drifted counter never lets the
--                    sample finish) and last_version the version of the last generated one.
--   group_version    the group version is min(V_traj) over its live members: a group's recorded
--                    version (`min_version`, as of its latest route; live members only leave or
--                    keep their V_traj after it) is never above a live member's V_traj.
--
-- As in audit_v2.sql, every branch exposes run_id from a base table or as a GROUP BY column, so
-- `WHERE run_id = X` is pushed into every branch (one linear pass over the run's rows each), no
-- CTE, and no subquery reads a table per row (the one per-row test walks two arrays in memory).
--
CREATE OR REPLACE VIEW lineage_violations AS
-- trained_once: placed groups against their group_occupied events, and groups with such an
-- event that are no longer placed (put back to be placed, and trained, again)
SELECT g.run_id, 'trained_once' AS invariant, 'group ' || g.id AS subject,
       format('%s%s; the event log placed it %s time(s)%s', g.state,
              CASE WHEN g.buffer IS NULL THEN ''
                   ELSE format(' in buffer %s at version %s', g.buffer, g.group_version) END,
              coalesce(e.n, 0),
              CASE WHEN e.n IS NULL THEN ''
                   ELSE format(', in buffer %s at version %s%s',
                               CASE WHEN e.lo = e.hi THEN e.lo::text ELSE e.lo || '..' || e.hi END,
                               coalesce(e.v::text, '-'),
                               CASE WHEN pb.consumed_at IS NOT NULL
                                    THEN format(', which is consumed: trained at step %s', e.lo) ELSE '' END)
              END) AS detail
FROM prompt_groups g
LEFT JOIN (SELECT run_id, group_id, count(*) AS n, min(buffer) AS lo, max(buffer) AS hi,
                  min((data ->> 'version')::int) AS v
           FROM events WHERE kind = 'group_occupied' GROUP BY run_id, group_id) e
       ON e.run_id = g.run_id AND e.group_id = g.id
LEFT JOIN buffers pb ON pb.run_id = g.run_id AND pb.idx = e.lo
WHERE CASE WHEN g.state IN ('occupied', 'consumed')
           THEN e.n IS NULL OR e.n <> 1 OR e.lo IS DISTINCT FROM g.buffer
           ELSE e.n IS NOT NULL
      END

-- segment_lineage: routes (sample_routed events in id order: route k = attempt k) against the
-- attempt counter and the segments; segment_count: the counters against the segments
UNION ALL
SELECT s.run_id, k.invariant, 'sample ' || s.id,
       CASE k.invariant
           WHEN 'segment_lineage'
               THEN format('attempt %s after %s routes (to instances %s); segments in seq order at attempts %s from instances %s',
                           s.attempt, coalesce(cardinality(rt.routes), 0), coalesce(rt.routes::text, '{}'),
                           coalesce(x.attempts::text, '{}'), coalesce(x.instances::text, '{}'))
           ELSE format('n_segments %s, last_version %s, but %s segments (seq %s..%s), the last at version %s',
                       s.n_segments, coalesce(s.last_version::text, '-'), coalesce(x.n, 0),
                       x.first_seq, x.last_seq, coalesce(x.last_version::text, '-'))
       END
FROM samples s
LEFT JOIN (SELECT run_id, sample_id, array_agg(instance_id ORDER BY id) AS routes
           FROM events WHERE kind = 'sample_routed' GROUP BY run_id, sample_id) rt
       ON rt.run_id = s.run_id AND rt.sample_id = s.id
LEFT JOIN (  -- narrow columns only (no token data), in seq order
    SELECT run_id, sample_id, count(*) AS n, min(seq) AS first_seq, max(seq) AS last_seq,
           (array_agg(version ORDER BY seq DESC) FILTER (WHERE generated))[1] AS last_version,
           array_agg(attempt ORDER BY seq) AS attempts, array_agg(instance_id ORDER BY seq) AS instances
    FROM segments GROUP BY run_id, sample_id
) x ON x.run_id = s.run_id AND x.sample_id = s.id
CROSS JOIN LATERAL (VALUES
    ('segment_lineage',
     s.attempt <> coalesce(cardinality(rt.routes), 0)
     OR EXISTS (SELECT 1 FROM generate_subscripts(x.attempts, 1) AS q(i)  -- arrays in memory, no table
                WHERE x.attempts[q.i] < x.attempts[q.i - 1]
                   OR x.instances[q.i] IS DISTINCT FROM rt.routes[x.attempts[q.i]])),
    ('segment_count',
     s.n_segments <> coalesce(x.n, 0) OR s.last_version IS DISTINCT FROM x.last_version)
) AS k(invariant, broken)
WHERE k.broken

-- group_version (live): a group's recorded version is at most the V_traj of each live member
-- (not aborted, and routed or holding tokens: rules.group_version), and recorded once one exists
UNION ALL
SELECT g.run_id, 'group_version', 'group ' || g.id,
       format('%s group recorded at version %s (as of its latest route), but its live member sample %s has V_traj %s',
              g.state, coalesce(g.min_version::text, 'none'), m.first, m.v)
FROM prompt_groups g
JOIN (SELECT run_id, group_id, min(v_traj) AS v, (array_agg(id ORDER BY v_traj, id))[1] AS first
      FROM samples
      WHERE v_traj IS NOT NULL AND state <> 'aborted' AND (state <> 'queued' OR n_tokens > 0)
      GROUP BY run_id, group_id) m
  ON m.run_id = g.run_id AND m.group_id = g.id
WHERE g.min_version IS NULL OR g.min_version > m.v;

-- name: view_turn_violations
-- The per-turn checks of multi-turn trajectories (docs/protocol.md, "Multi-turn"), as (run_id,
-- invariant, subject, detail). A trajectory's segments are generated turns (generated, at a
-- version) and environment observations (not generated: no version, loss mask 0; a CHECK
-- constraint ties the two). staleness_violations_v2's segment_version compares neighbouring
-- segments only, so a version going down across an observation is caught here:
--   turn_version   every generated segment is at a version >= the generated segment before it,
--                  across observations: the staleness bound holds per trajectory, all turns.
--   observation    an observation carries log-prob 0 for each token (loss mask 0, nothing
--                  sampled), follows a generated turn or the prompt (never another observation:
--                  one observation per turn), and a finished trajectory ends with a generated
--                  turn (the environment ended it after the model's turn).
-- Same shape as lineage_violations: run_id from a base table in every branch.
CREATE OR REPLACE VIEW turn_violations AS
SELECT w.run_id, 'turn_version' AS invariant, 'sample ' || w.sample_id AS subject,
       format('generated segment %s at version %s after an observation, the generated segment before it at version %s',
              w.seq, w.version, w.prev_generated) AS detail
FROM (SELECT run_id, sample_id, seq, version, generated,
             lag(generated) OVER (PARTITION BY run_id, sample_id ORDER BY seq) AS prev_is_generated,
             max(version) OVER (PARTITION BY run_id, sample_id ORDER BY seq
                                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_generated
      FROM segments) w
WHERE w.generated AND w.prev_is_generated = false AND w.version < w.prev_generated
UNION ALL
SELECT o.run_id, 'observation', 'sample ' || o.sample_id,
       format('observation segment %s: %s', o.seq,
              CASE WHEN o.logprob_sum <> 0 THEN 'log-probs are not 0 (it was not sampled)'
                   WHEN o.prev_is_generated = false THEN 'follows another observation'
                   ELSE format('ends the %s trajectory', s.state) END)
FROM (SELECT run_id, sample_id, seq, generated,
             (SELECT coalesce(sum(abs(z)), 0) FROM unnest(logprobs) AS z) AS logprob_sum,
             lag(generated) OVER (PARTITION BY run_id, sample_id ORDER BY seq) AS prev_is_generated,
             lead(seq) OVER (PARTITION BY run_id, sample_id ORDER BY seq) AS next_seq
      FROM segments) o
JOIN samples s ON s.id = o.sample_id AND s.run_id = o.run_id
WHERE NOT o.generated
  AND (o.logprob_sum <> 0 OR o.prev_is_generated = false
       OR (o.next_seq IS NULL AND s.state IN ('finished', 'scoring', 'rewarded')))

-- name: view_staleness_violations
-- Every broken invariant: the spec's and conservation's (staleness_violations_v2), the lineage
-- checks and the per-turn checks. What `staleflow audit`, /v1/audit/violations and the
-- dashboard read.
CREATE OR REPLACE VIEW staleness_violations AS
SELECT run_id, invariant, subject, detail FROM staleness_violations_v2
UNION ALL
SELECT run_id, invariant, subject, detail FROM lineage_violations
UNION ALL
SELECT run_id, invariant, subject, detail FROM turn_violations

-- name: view_trained_lineage
-- The lineage of every trained token (docs/data-layer.md, "Lineage"): one row per segment of a
-- trained sample, in seq order. A generated segment names the model version and instance that
-- generated it, that version's published checksum and location (version v was published by
-- training step v - 1; version 0 is the initial model, published by nobody) and the route
-- attempt; an observation (multi-turn) has no version. The sample's reward, its metrics, its
-- claim attempt and the API token that posted it (the scorer; NULL when recorded in-process)
-- repeat on each of its rows. The complete audit proves the chain: segment_version keeps every
-- generated version between V_traj and the training step, and contiguity gives every step
-- below the run's version a published version.
CREATE OR REPLACE VIEW trained_lineage AS
SELECT s.run_id, g.buffer AS step, s.id AS sample_id, s.group_id, s.idx, s.v_traj,
       g.buffer - s.v_traj AS staleness,
       x.seq, x.generated, x.version, x.instance_id, i.name AS instance_name, x.attempt,
       cardinality(x.token_ids) AS n_tokens, x.finish_reason, x.created_at AS segment_at,
       pv.checksum, pv.location, pv.created_at AS published_at,
       CASE WHEN x.version > 0 THEN x.version - 1 END AS published_by_step,
       s.reward, s.reward_metrics, s.reward_attempt,
       s.reward_token_id AS scorer_token_id, t.name AS scorer_name, t.role::text AS scorer_role
FROM samples s
JOIN prompt_groups g ON g.id = s.group_id AND g.state = 'consumed'
JOIN segments x ON x.sample_id = s.id
LEFT JOIN instances i ON i.id = x.instance_id
LEFT JOIN param_versions pv ON pv.run_id = s.run_id AND pv.version = x.version
LEFT JOIN api_tokens t ON t.id = s.reward_token_id
WHERE s.state = 'rewarded'

