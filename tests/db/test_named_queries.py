"""Every named query (`staleflow_db/sql/`) against the migrated schema: each statement is
PREPAREd (so a renamed column or a wrong type fails here, not in production), and the named
DDL is exactly what the migrations applied."""

from __future__ import annotations

import re

import psycopg
import pytest

from staleflow_db import queries
from staleflow_db.protocol.core import fast_or_run_lock_sql, if_fast_sql

# statements PREPARE does not take: checked by running them in a transaction rolled back
UTILITY = re.compile(r"^(SET|LISTEN)\b")
DDL_OBJECT = re.compile(r"^CREATE OR REPLACE (VIEW|FUNCTION) (\w+)")


def composed() -> dict[str, str]:
    """The statements the data layer composes from named parts (`queries.with_parts`), each
    with every part it can have."""
    return {
        "flush": queries.with_parts(
            [
                queries.sql("flush_buffers"),
                queries.sql("flush_moved"),
                queries.prefixed("route_samples", "x0_"),
                queries.prefixed("route_groups", "x1_"),
                queries.prefixed("occupy_groups", "x2_"),
                queries.prefixed("events_insert", "e_"),
            ],
            queries.sql("flush_done"),
        ),
        **{
            f"fast_or_run_lock_{guess}": fast_or_run_lock_sql(guess)
            for guess in ("rewards_fast_check", "route_groups_reserved")
        },
        "if_fast_rewards_fast_check": if_fast_sql("rewards_fast_check"),
        "report": queries.with_parts(
            [queries.sql("report_segments"), queries.prefixed("events_insert", "e_")], queries.sql("report_samples")
        ),
    }


def statements() -> dict[str, str]:
    return {q.name: q.sql for q in queries.QUERIES.values() if not q.is_ddl} | composed()


def test_every_named_query_prepares_against_the_migrated_schema(db_url):
    failed = {}
    with psycopg.connect(db_url, autocommit=True) as conn:  # a utility statement opens its own transaction
        for name, sql in statements().items():
            try:
                if UTILITY.match(sql):
                    with conn.transaction(force_rollback=True):
                        conn.execute(sql)
                else:
                    positional, _ = queries.positional(sql)
                    conn.execute(f"PREPARE named_query AS {positional}")
                    conn.execute("DEALLOCATE named_query")
            except psycopg.Error as e:
                failed[name] = str(e).splitlines()[0]
    assert failed == {}


def test_a_statement_that_does_not_fit_the_schema_fails_the_check(db_url):
    with psycopg.connect(db_url) as conn, pytest.raises(psycopg.errors.UndefinedColumn):
        sql, _ = queries.positional(queries.sql("load_run").replace("dapo_filter", "dapo_filtre"))
        conn.execute(f"PREPARE named_query AS {sql}")


def definition(conn: psycopg.Connection, kind: str, name: str) -> str:
    if kind == "VIEW":
        return conn.execute("SELECT pg_get_viewdef(to_regclass(%s))", (name,)).fetchone()[0]
    (got,) = conn.execute(
        "SELECT pg_get_functiondef(p.oid) FROM pg_proc p WHERE p.proname = %s AND p.pronamespace = "
        "to_regnamespace('public')",
        (name,),
    ).fetchall()
    return got[0]


@pytest.mark.parametrize("name", [q.name for q in queries.ddl()])
def test_the_migrated_schema_has_the_named_ddl(db_url, name):
    """Applying the file's definition again changes nothing (in a transaction rolled back)."""
    sql = queries.sql(name)
    kind, obj = DDL_OBJECT.match(sql).groups()
    with psycopg.connect(db_url) as conn, conn.transaction(force_rollback=True):
        migrated = definition(conn, kind, obj)
        conn.execute(sql)
        assert definition(conn, kind, obj) == migrated
