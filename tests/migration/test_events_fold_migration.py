"""Migration 0016 on a log with history: the downgrade unnests every fold into flat rows and the
upgrade folds them again, the logical log (every event, in order) the same on both sides and the
audit of the run still empty."""

from __future__ import annotations

from audit_helpers import healthy_run
from sqlalchemy import text

from staleflow_db import migrate
from staleflow_db.audit import violations

COLUMNS = "run_id, kind, sample_id, group_id, buffer, instance_id, data"


def _log(engine, order: str) -> list[tuple]:
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(text(f"SELECT {COLUMNS} FROM events ORDER BY {order}"))]


def _count(engine, table: str) -> int:
    with engine.connect() as c:
        return c.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()


def test_the_log_survives_a_downgrade_and_an_upgrade(engine, db_url):
    h = healthy_run(engine)
    logged = _log(engine, "id, ord")
    assert _count(engine, "event_rows") < len(logged)
    engine.dispose()

    migrate.downgrade(db_url, "0014")
    assert _log(engine, "id") == logged  # the flat table, in the same order
    engine.dispose()

    migrate.upgrade(db_url)
    assert _log(engine, "id, ord") == logged
    assert _count(engine, "event_rows") < len(logged)
    assert violations(engine, h.run) == []
