"""Compact events: a statement's events of one kind are one row of `event_rows`, and `events` is
a view with one logical event per row, as the table was.

`event_rows` (the table `events` renamed) keeps the scalar columns for a single event and gains
arrays for a fold of n >= 2 events (`n`; `sample_ids`, `group_ids`, `buffers`, `instance_ids`,
an array NULL when all its elements are; `data` the JSON array of the events' data, NULL when all
are). `group_occupied` is never folded (CHECK), so the trained-once check keeps its partial index;
`ix_event_rows_folds` finds a run's folds of a kind.
The view `events` unnests folds (their events share the row's id; `ord` is the position inside
it) and accepts single-event INSERTs (INSTEAD OF trigger); UPDATE and DELETE stay refused. Every
reader keeps reading `events`: the named views are applied again so they select from the view.

Existing events of one run, kind and transaction are folded in id order; the downgrade unnests
every fold and numbers all events again in (id, ord) order.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

ARRAYS = (
    ("sample_ids", sa.BigInteger),
    ("group_ids", sa.BigInteger),
    ("buffers", sa.Integer),
    ("instance_ids", sa.BigInteger),
)

# a fold's arrays: absent, or one dimension of n elements from subscript 1 (what the view reads)
_FOLD_ARRAYS = " AND ".join(
    f"({a} IS NULL OR (array_ndims({a}) = 1 AND array_lower({a}, 1) = 1 AND cardinality({a}) = n))" for a, _ in ARRAYS
)
CHECKS = {
    "ck_event_rows_fold": "n IS NULL OR (n >= 2 AND sample_id IS NULL AND group_id IS NULL AND buffer IS NULL"
    f" AND instance_id IS NULL AND kind <> 'group_occupied' AND {_FOLD_ARRAYS}"
    " AND (data IS NULL OR (jsonb_typeof(data) = 'array' AND jsonb_array_length(data) = n)))",
    "ck_event_rows_single": "n IS NOT NULL OR (sample_ids IS NULL AND group_ids IS NULL AND buffers IS NULL"
    " AND instance_ids IS NULL)",
}

VIEW = """
CREATE VIEW events AS
SELECT r.id, r.run_id, r.at, r.kind, r.sample_id, r.group_id, r.buffer, r.instance_id, r.data, 1 AS ord
FROM event_rows r WHERE r.n IS NULL
UNION ALL
SELECT r.id, r.run_id, r.at, r.kind, r.sample_ids[o.o], r.group_ids[o.o], r.buffers[o.o], r.instance_ids[o.o],
       nullif(r.data -> (o.o - 1), 'null'::jsonb), o.o
FROM event_rows r CROSS JOIN LATERAL generate_series(1, r.n) AS o(o) WHERE r.n IS NOT NULL
"""

# a single event written through the view (hand-written rows; writers of the table before 0016)
INSERT_FUNCTION = """
CREATE FUNCTION staleflow_event_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO event_rows (run_id, at, kind, sample_id, group_id, buffer, instance_id, data)
    VALUES (NEW.run_id, coalesce(NEW.at, now()), NEW.kind, NEW.sample_id, NEW.group_id, NEW.buffer,
            NEW.instance_id, NEW.data)
    RETURNING id, at INTO NEW.id, NEW.at;
    NEW.ord := 1;
    RETURN NEW;
END $$
"""

# events of one run, kind and transaction (xmin; the same `at`), in id order, as one row each
FOLD_EXISTING = """
CREATE TEMP TABLE event_folds ON COMMIT DROP AS
SELECT min(id) AS id, run_id, at, kind, count(*)::int AS n, array_agg(id) AS ids,
       CASE WHEN count(sample_id) > 0 THEN array_agg(sample_id ORDER BY id) END AS sample_ids,
       CASE WHEN count(group_id) > 0 THEN array_agg(group_id ORDER BY id) END AS group_ids,
       CASE WHEN count(buffer) > 0 THEN array_agg(buffer ORDER BY id) END AS buffers,
       CASE WHEN count(instance_id) > 0 THEN array_agg(instance_id ORDER BY id) END AS instance_ids,
       CASE WHEN count(data) > 0 THEN jsonb_agg(coalesce(data, 'null'::jsonb) ORDER BY id) END AS data
FROM event_rows WHERE kind <> 'group_occupied'
GROUP BY run_id, kind, xmin::text, at HAVING count(*) > 1;
ALTER TABLE event_rows DISABLE TRIGGER events_append_only;
DELETE FROM event_rows WHERE id IN (SELECT unnest(ids) FROM event_folds);
INSERT INTO event_rows (id, run_id, at, kind, n, sample_ids, group_ids, buffers, instance_ids, data)
SELECT id, run_id, at, kind, n, sample_ids, group_ids, buffers, instance_ids, data FROM event_folds;
ALTER TABLE event_rows ENABLE TRIGGER events_append_only;
DROP TABLE event_folds
"""

UNFOLD_ALL = """
CREATE TEMP TABLE event_list ON COMMIT DROP AS
SELECT row_number() OVER (ORDER BY id, ord) AS id, run_id, at, kind, sample_id, group_id, buffer, instance_id, data
FROM events_unfolded;
ALTER TABLE events DISABLE TRIGGER events_append_only;
DELETE FROM events;
INSERT INTO events (id, run_id, at, kind, sample_id, group_id, buffer, instance_id, data)
SELECT id, run_id, at, kind, sample_id, group_id, buffer, instance_id, data FROM event_list;
ALTER TABLE events ENABLE TRIGGER events_append_only;
SELECT setval(pg_get_serial_sequence('events', 'id'), coalesce((SELECT max(id) FROM event_list), 0) + 1, false);
DROP TABLE event_list
"""


def _apply_named_ddl() -> None:
    """The named views again: their text says `events`, which the renames just moved. The audit
    views as 0015 left them (frozen), so a later change to audit.sql does not land here."""
    from staleflow_db import queries

    for statement in queries.ddl_statements("audit_views_v4.sql"):
        op.execute(sa.text(statement))


def _execute(script: str) -> None:
    for statement in script.split(";\n"):
        op.execute(sa.text(statement))


def _rename_not_null(table: str, old_prefix: str) -> None:
    """PostgreSQL 18 names NOT NULL constraints `<table>_<column>_not_null` and a table rename
    leaves those names behind (as in 0010): they follow the table (older servers keep none)."""
    op.execute(
        f"""DO $$ DECLARE r record; BEGIN
  FOR r IN SELECT conname FROM pg_constraint WHERE conrelid = '{table}'::regclass AND contype = 'n'
      AND conname LIKE '{old_prefix}\\_%\\_not\\_null' LOOP
    EXECUTE format('ALTER TABLE {table} RENAME CONSTRAINT %I TO %I', r.conname,
                   '{table}' || substr(r.conname, {len(old_prefix) + 1}));
  END LOOP;
END $$"""
    )


def upgrade() -> None:
    op.rename_table("events", "event_rows")
    _rename_not_null("event_rows", "events")
    op.add_column("event_rows", sa.Column("n", sa.Integer()))
    for name, kind in ARRAYS:
        op.add_column("event_rows", sa.Column(name, sa.ARRAY(kind)))
    for name, check in CHECKS.items():
        op.create_check_constraint(op.f(name), "event_rows", check)
    # the folds by kind: a reader of a kind through the view (e.g. the trained-once check, whose
    # singles come by ix_events_group_occupied) finds its folds without a pass over the run
    op.create_index("ix_event_rows_folds", "event_rows", ["run_id", "kind"], postgresql_where=sa.text("n IS NOT NULL"))
    _execute(FOLD_EXISTING)
    op.execute(VIEW)
    op.execute(INSERT_FUNCTION)
    op.execute(
        "CREATE TRIGGER events_insert INSTEAD OF INSERT ON events FOR EACH ROW EXECUTE FUNCTION staleflow_event_insert()"
    )
    op.execute(
        "CREATE TRIGGER events_append_only INSTEAD OF UPDATE OR DELETE ON events"
        " FOR EACH ROW EXECUTE FUNCTION staleflow_append_only()"
    )
    _apply_named_ddl()


def downgrade() -> None:
    op.execute("ALTER VIEW events RENAME TO events_unfolded")
    op.rename_table("event_rows", "events")
    _rename_not_null("events", "event_rows")
    _apply_named_ddl()
    _execute(UNFOLD_ALL)
    op.execute("DROP VIEW events_unfolded")
    op.execute("DROP FUNCTION staleflow_event_insert()")
    op.drop_index("ix_event_rows_folds", "events")
    for name in CHECKS:
        op.drop_constraint(op.f(name), "events", type_="check")
    for name, _ in reversed(ARRAYS):
        op.drop_column("events", name)
    op.drop_column("events", "n")
