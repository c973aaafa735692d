"""No index of the schema is covered by another: a sample's every state change is a non-HOT
update (`state` is in the partial indexes' predicates), and a non-HOT update inserts into every
index whose predicate the new row meets, so a redundant index costs an insert and a WAL record
on every transition (migration 0022)."""

from __future__ import annotations

from sqlalchemy import text

# Pairs (covered, covering) on one table: the covered index's key columns are a leading prefix
# of the covering one's, both have the same predicate (or none), and the covered one enforces
# nothing the covering one does not (it is not unique, or both are unique on the same columns).
REDUNDANT = """
WITH ix AS (
  SELECT i.indexrelid, i.indrelid, i.indisunique, string_to_array(i.indkey::text, ' ')::int[] AS cols,  -- 1-based, as int2vector is not
         coalesce(pg_get_expr(i.indpred, i.indrelid), '') AS pred,
         i.indexprs IS NOT NULL AS has_exprs
  FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE n.nspname = current_schema() AND c.relkind = 'r'
)
SELECT a.indexrelid::regclass::text AS covered, b.indexrelid::regclass::text AS covering
FROM ix a JOIN ix b ON a.indrelid = b.indrelid AND a.indexrelid <> b.indexrelid
WHERE NOT a.has_exprs AND NOT b.has_exprs AND a.pred = b.pred
  AND cardinality(a.cols) <= cardinality(b.cols)
  AND a.cols = b.cols[1:cardinality(a.cols)]
  AND (NOT a.indisunique OR (b.indisunique AND a.cols = b.cols))
  AND (a.cols <> b.cols OR a.indexrelid > b.indexrelid)
ORDER BY 1, 2
"""


def redundant(conn) -> list[tuple[str, str]]:
    return [tuple(r) for r in conn.execute(text(REDUNDANT))]


def test_no_index_is_covered_by_another(engine):
    with engine.connect() as conn:
        assert redundant(conn) == []


def test_the_check_finds_a_forged_redundant_index(engine):
    """The query is proved on the broken states it must catch, and on the ones it must not."""
    with engine.connect() as conn:  # never committed
        conn.execute(text("CREATE INDEX forged_samples_group ON samples (group_id)"))
        conn.execute(text("CREATE INDEX forged_twin ON samples (group_id, idx)"))
        conn.execute(text("CREATE INDEX forged_run_id ON samples (run_id, id)"))
        # not redundant: another predicate, or a unique index a wider one cannot stand in for
        conn.execute(text("CREATE INDEX forged_finished_group ON samples (group_id) WHERE state = 'finished'"))
        conn.execute(text("CREATE UNIQUE INDEX forged_unique_id_run ON samples (id, run_id)"))
        found = redundant(conn)
        conn.rollback()
    assert ("forged_samples_group", "uq_samples_group_id_idx") in found
    assert ("forged_twin", "uq_samples_group_id_idx") in found
    assert ("uq_samples_group_id_idx", "forged_twin") not in found  # the unique one enforces a rule
    assert not any(covered == "forged_run_id" for covered, _ in found)  # ix_samples_queued is partial
    assert not any(covered in ("forged_finished_group", "forged_unique_id_run") for covered, _ in found)
    assert ("samples_pkey", "forged_unique_id_run") not in found  # a unique key is not covered by a wider one
