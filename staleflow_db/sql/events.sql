-- The event log (staleflow_db/protocol/events.py): append-only. A statement's events of one kind
-- are one row of `event_rows` (a fold: arrays, migration 0016); the view `events` reads them
-- back one event per row.

-- name: events_insert
-- One INSERT for any number of events (also a part of larger statements, its parameters
-- prefixed: `queries.prefixed`): one row per kind, a single event in the scalar columns; the
-- folds in the order of their first event. `group_occupied` stays one row per event (the
-- trained-once check's partial index). The data come as one JSON array (parsed once: the scalar
-- subquery is an InitPlan); an all-NULL array or data is stored as NULL.
INSERT INTO event_rows (run_id, kind, sample_id, group_id, buffer, instance_id, data,
  n, sample_ids, group_ids, buffers, instance_ids)
SELECT :run, f.k,
  CASE WHEN f.n = 1 THEN f.s[1] END, CASE WHEN f.n = 1 THEN f.g[1] END,
  CASE WHEN f.n = 1 THEN f.b[1] END, CASE WHEN f.n = 1 THEN f.i[1] END,
  CASE WHEN f.nd = 0 THEN NULL WHEN f.n = 1 THEN f.d -> 0 ELSE f.d END,
  nullif(f.n, 1),
  CASE WHEN f.n > 1 AND f.ns > 0 THEN f.s END, CASE WHEN f.n > 1 AND f.ng > 0 THEN f.g END,
  CASE WHEN f.n > 1 AND f.nb > 0 THEN f.b END, CASE WHEN f.n > 1 AND f.ni > 0 THEN f.i END
FROM (SELECT u.k, count(*)::int AS n, min(u.o) AS first,
  array_agg(u.s ORDER BY u.o) AS s, count(u.s) AS ns, array_agg(u.g ORDER BY u.o) AS g, count(u.g) AS ng,
  array_agg(u.b ORDER BY u.o) AS b, count(u.b) AS nb, array_agg(u.i ORDER BY u.o) AS i, count(u.i) AS ni,
  jsonb_agg(u.d ORDER BY u.o) AS d, count(*) FILTER (WHERE u.d <> 'null') AS nd
  FROM (SELECT x.k, x.s, x.g, x.b, x.i, x.o, (SELECT CAST(:d AS jsonb)) -> (x.o::int - 1) AS d
    FROM unnest(CAST(:k AS text[]), CAST(:s AS bigint[]), CAST(:g AS bigint[]), CAST(:b AS int[]),
    CAST(:i AS bigint[])) WITH ORDINALITY AS x(k, s, g, b, i, o)) u
  GROUP BY u.k, CASE WHEN u.k = 'group_occupied' THEN u.o END) f
ORDER BY f.first

-- name: function_append_only
-- Segments and events are history (a trainer may already have consumed them): their rows
-- never change. The triggers (migration 0001) call this.
CREATE OR REPLACE FUNCTION staleflow_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END $$
