"""Engines, URLs, migrations API and the per-test database fixtures, on a real server."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from staleflow_db import migrate
from staleflow_db.db import database_url, make_engine, with_database
from staleflow_db.embedded import EmbeddedPostgres
from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig


def test_engine_sets_session_timeouts(engine) -> None:
    with engine.connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "30s"
        assert conn.execute(text("SHOW lock_timeout")).scalar() == "10s"
        assert conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar() == "1min"
        assert conn.execute(text("SHOW application_name")).scalar() == "staleflow"
    assert engine.dialect.driver == "psycopg"
    assert engine.pool._pre_ping


def test_statement_timeout_is_enforced(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALEFLOW_STATEMENT_TIMEOUT", "200ms")
    eng = make_engine(db_url)
    try:
        with eng.connect() as conn, pytest.raises(OperationalError, match="statement timeout"):
            conn.execute(text("SELECT pg_sleep(5)"))
    finally:
        eng.dispose()


def test_database_url_prefers_env(db_url: str) -> None:
    # db_url exports STALEFLOW_DATABASE_URL, so code under test lands in this database.
    assert database_url() == db_url
    eng = make_engine()
    try:
        with eng.connect() as conn:
            assert conn.execute(text("SELECT current_database()")).scalar() == db_url.rsplit("/", 1)[1]
    finally:
        eng.dispose()


def test_with_database() -> None:
    assert (
        with_database("postgresql://u:p%40ss@h:1/a?sslmode=disable", "b")
        == "postgresql://u:p%40ss@h:1/b?sslmode=disable"
    )


def test_each_test_gets_a_fresh_migrated_copy(db_url: str, admin_url: str, template_db: str) -> None:
    assert migrate.current(db_url) == migrate.head()
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE scratch (x int)")
    with psycopg.connect(with_database(admin_url, template_db)) as conn:
        assert conn.execute("SELECT to_regclass('scratch')").fetchone() == (None,)


def test_downgrade_and_upgrade_round_trip(db_url: str) -> None:
    head = migrate.head()
    if head is None:
        pytest.skip("no migrations yet")
    migrate.downgrade(db_url, "base")
    assert migrate.current(db_url) is None
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == head


@pytest.mark.embedded
def test_database_url_starts_embedded_server(embedded_pg: EmbeddedPostgres, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STALEFLOW_DATABASE_URL", raising=False)
    monkeypatch.setenv("STALEFLOW_HOME", str(embedded_pg.home))
    url = database_url()
    assert embedded_pg.is_running() and url == embedded_pg.url()
    assert database_url() == url  # reused, not restarted


def _views_and_functions(url: str) -> tuple[dict[str, str], dict[str, str]]:
    with psycopg.connect(url) as conn:
        views = conn.execute(
            "SELECT viewname, pg_get_viewdef(viewname::regclass) FROM pg_views WHERE schemaname = 'public'"
        ).fetchall()
        functions = conn.execute(
            "SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public'"
        ).fetchall()
    return dict(views), dict(functions)


def test_the_named_ddl_equals_what_migrations_0001_to_0007_created(db_url: str) -> None:
    """0008 applies the named DDL of staleflow_db/sql/ and its downgrade undoes nothing: that is
    right only while the files define each view and function exactly as the history did."""
    migrate.downgrade(db_url, "0007")
    before = _views_and_functions(db_url)
    migrate.upgrade(db_url, "0008")
    assert _views_and_functions(db_url) == before
    assert set(before[0]) >= {"staleness_violations", "lineage_violations", "staleness_violations_v2"}


def _lease_names(url: str) -> tuple[list[tuple[str, str]], list[str]]:
    with psycopg.connect(url) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'"
            " AND table_name IN ('samples', 'buffers')"
            " AND column_name IN ('lease', 'leased_at', 'route_token', 'consume_fence', 'consume_fence_at')"
            " ORDER BY 1, 2"
        ).fetchall()
        constraints = conn.execute(
            "SELECT conname FROM pg_constraint WHERE contype IN ('p', 'f') AND conrelid IN (SELECT oid FROM pg_class"
            " WHERE relname IN ('coordinator_leases', 'leader_epochs')) ORDER BY 1"
        ).fetchall()
    return [tuple(c) for c in columns], [c for (c,) in constraints]


def _stale_not_null_names(url: str) -> list[str]:
    """PostgreSQL 18 names NOT NULL constraints `<table>_<column>_not_null` (older servers keep
    none in pg_constraint): those not named after their table and column as they are now."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT c.conname, c.conrelid::regclass::text || '_' || a.attname || '_not_null' FROM pg_constraint c"
            " JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1] WHERE c.contype = 'n'"
        ).fetchall()
    return sorted(name for name, expected in rows if name != expected)


def test_0010_renames_the_leases_and_its_downgrade_restores_them(db_url: str, engine) -> None:
    """Renames only: a downgrade to 0009 gives back the old names, the upgrade the new ones,
    the data stays, and the views and functions are the same either way."""
    new = (
        [("buffers", "consume_fence"), ("buffers", "consume_fence_at"), ("samples", "route_token")],
        ["fk_leader_epochs_run_id", "pk_leader_epochs"],
    )
    assert _lease_names(db_url) == new
    before = _views_and_functions(db_url)
    p = Protocol(engine)
    run = p.create_run("r", RunConfig(batch_size=1, group_size=1, eta=1))
    assert p.acquire_leadership(run, "h", 30.0) == 1
    engine.dispose()  # no pooled connection holds the tables while they are renamed
    migrate.downgrade(db_url, "0009")
    assert _lease_names(db_url) == (
        [("buffers", "lease"), ("buffers", "leased_at"), ("samples", "lease")],
        ["fk_coordinator_leases_run_id", "pk_coordinator_leases"],
    )
    assert _stale_not_null_names(db_url) == []
    migrate.upgrade(db_url)
    assert _lease_names(db_url) == new
    assert _stale_not_null_names(db_url) == []
    assert _views_and_functions(db_url) == before
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT run_id, holder, epoch FROM leader_epochs").fetchall() == [(run, "h", 1)]
