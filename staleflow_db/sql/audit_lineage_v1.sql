-- The lineage checks of the complete audit (migration 0007), as (run_id, invariant, subject,
-- detail): each compares a row with what it derives from — the append-only history (the event
-- log and the segments) or, for a group's version, its live members. audit_v2.sql's checks stay
-- as they were (0007 renames that view `staleness_violations_v2`); `staleness_violations` is
-- both together, so every reader (`staleflow audit`, /v1/audit/violations, the dashboard) gets
-- these rows too. Empty in a healthy run, also between any two protocol transactions. Never edit
-- this file once released: a later migration that changes these views ships a new file.
--
-- Written from the spec (docs/protocol.md), not from the protocol code:
--   trained_once     a group is placed once and trained at most once: its row names the buffer
--                    of its one `group_occupied` event, and a group with such an event stays
--                    placed (occupied, then consumed). A trained group swapped with an
--                    untrained one keeps every counter right, but not this.
--   segment_lineage  attempts are lease tokens: route k of a sample is its attempt k (its k-th
--                    `sample_routed` event), a sample's attempt counter is its number of routes,
--                    its segments' attempts never decrease along seq, and a segment of attempt k
--                    came from the instance route k sent it to.
--   segment_count    a sample's counters agree with its segments: n_segments is their number
--                    (the next report writes seq n_segments, so a drifted counter never lets the
--                    sample finish) and last_version the version of the last one.
--   group_version    the group version is min(V_traj) over its live members: a group's recorded
--                    version (`min_version`, as of its latest route; live members only leave or
--                    keep their V_traj after it) is never above a live member's V_traj.
--
-- As in audit_v2.sql, every branch exposes run_id from a base table or as a GROUP BY column, so
-- `WHERE run_id = X` is pushed into every branch (one linear pass over the run's rows each), no
-- CTE, and no subquery reads a table per row (the one per-row test walks two arrays in memory).
--
-- Each statement below follows its `-- name:` line; 0007 runs them in order.

-- name: lineage_violations
CREATE VIEW lineage_violations AS
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
           (array_agg(version ORDER BY seq DESC))[1] AS last_version,
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

-- name: staleness_violations
CREATE VIEW staleness_violations AS
SELECT run_id, invariant, subject, detail FROM staleness_violations_v2
UNION ALL
SELECT run_id, invariant, subject, detail FROM lineage_violations;
