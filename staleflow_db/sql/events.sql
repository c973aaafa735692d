-- The event log (staleflow_db/protocol/events.py): append-only, one row per transition.

-- name: events_insert
-- One multi-row INSERT for any number of events (also a part of larger statements, its
-- parameters prefixed: `queries.prefixed`). The data come as one JSON array (parsed once:
-- the scalar subquery is an InitPlan) and JSON null is stored as NULL.
INSERT INTO events (run_id, kind, sample_id, group_id, buffer, instance_id, data)
SELECT :run, u.k, u.s, u.g, u.b, u.i, nullif((SELECT CAST(:d AS jsonb)) -> (u.o::int - 1), 'null')
FROM unnest(CAST(:k AS text[]), CAST(:s AS bigint[]), CAST(:g AS bigint[]), CAST(:b AS int[]),
CAST(:i AS bigint[])) WITH ORDINALITY AS u(k, s, g, b, i, o)

-- name: function_append_only
-- Segments and events are history (a trainer may already have consumed them): their rows
-- never change. The triggers (migration 0001) call this.
CREATE OR REPLACE FUNCTION staleflow_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END $$
