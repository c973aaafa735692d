"""The migrations build exactly the tables of staleflow_db.schema."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from staleflow_db.schema import metadata


def test_upgrade_from_empty_equals_the_models(engine):
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_audit_views_exist_and_start_empty(engine):
    with engine.connect() as conn:
        for view in ("trained_samples", "dropped_samples", "staleness_violations"):
            assert conn.execute(text(f"SELECT count(*) FROM {view}")).scalar() == 0
