"""The named-query loader (`staleflow_db.queries`) and the rule that only staleflow_db sends SQL:
api/, workers/ and staleflow_cli/ call functions of staleflow_db, never SQL text of their own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from staleflow_db import queries

ROOT = Path(__file__).resolve().parents[2]


def test_a_file_parses_into_named_statements_on_one_line_without_comments():
    got = queries.parse(
        "-- a file's description\n\n"
        "-- name: first\n-- what it does\nSELECT a -- trailing\n  FROM t WHERE x = '--no comment'\n\n"
        "-- name: second\n-- a description\nCREATE OR REPLACE FUNCTION f() RETURNS int LANGUAGE sql AS $$\n"
        "  -- kept\n  SELECT 1\n$$;\n",
        "x.sql",
    )
    assert [(q.name, q.sql) for q in got] == [
        ("first", "SELECT a FROM t WHERE x = '--no comment'"),
        ("second", "CREATE OR REPLACE FUNCTION f() RETURNS int LANGUAGE sql AS $$\n  -- kept\n  SELECT 1\n$$"),
    ]


@pytest.mark.parametrize(
    "source, error",
    [
        ("SELECT 1\n-- name: a\nSELECT 2\n", "before the first"),
        ("-- name: a\n", "empty"),
        ("-- name: Bad-Name\nSELECT 1\n", "lower_snake_case"),
    ],
)
def test_a_malformed_file_fails_loudly(source, error):
    with pytest.raises(ValueError, match=error):
        queries.parse(source, "x.sql")


def test_a_duplicate_name_fails_the_load_and_an_unknown_name_the_call(tmp_path):
    (tmp_path / "a.sql").write_text("-- name: q\nSELECT 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.sql").write_text("-- name: q\nSELECT 2\n")
    with pytest.raises(ValueError, match="'q' is defined in a.sql and again in sub/b.sql"):
        queries.load(tmp_path)
    with pytest.raises(queries.UnknownQuery):
        queries.text("no_such_query")


def test_frozen_migration_files_are_not_named_queries(tmp_path):
    (tmp_path / "audit_v2.sql").write_text("CREATE VIEW v AS SELECT 1;\n")
    (tmp_path / "a.sql").write_text("-- name: q\nSELECT 1\n")
    assert list(queries.load(tmp_path)) == ["q"]


def test_parameters_convert_for_psycopg_and_prepare():
    sql = "SELECT CAST(:run AS bigint), x::int, '5%', :ids, :run"
    assert queries.to_pyformat(sql) == "SELECT CAST(%(run)s AS bigint), x::int, '5%%', %(ids)s, %(run)s"
    assert queries.positional(sql) == ("SELECT CAST($1 AS bigint), x::int, '5%', $2, $1", ["run", "ids"])


def test_prefixed_parts_compose_into_one_statement():
    part = queries.prefixed("events_insert", "e_")
    assert ":e_run" in part and ":run" not in part
    assert queries.with_parts([part], "SELECT 1") == f"WITH w0 AS ({part}) SELECT 1"
    assert queries.with_parts([], "SELECT 1") == "SELECT 1"


def test_ddl_has_no_parameters():
    assert queries.ddl() and all(not q.params for q in queries.ddl())


# ---- only staleflow_db sends SQL ------------------------------------------------------------

OUTSIDE = ("api", "workers", "staleflow_cli")
SENDS = {"execute", "exec_driver_sql", "executemany", "text", "scalar", "scalars"}
# the start of an SQL statement (uppercase, as this code base writes SQL; prose and log
# messages such as "NOTIFY failed: %s" or an HTTP "DELETE" do not match)
SQL = re.compile(
    r"""^\s*(
      SELECT\s | INSERT\s+INTO\s | UPDATE\s+\w+(\s+\w+)?\s+SET\s | DELETE\s+FROM\s | MERGE\s+INTO\s
    | WITH\s+(RECURSIVE\s+)?\w+(\s*\([^)]*\))?\s+AS\s
    | (CREATE|ALTER|DROP)\s+(OR\s+REPLACE\s+)?(TABLE|VIEW|FUNCTION|INDEX|TYPE|TRIGGER|DATABASE|SCHEMA|EXTENSION|SEQUENCE)\b
    | LOCK\s+(TABLE\s+)?\w | SET\s+(LOCAL|SESSION|TRANSACTION)\b | SET\s+\w+\s*(=|TO)\s
    | (UN)?LISTEN\s+\w+\s*;?\s*$ | NOTIFY\s+\w+\s*(,|;|$) | TRUNCATE\s | (BEGIN|COMMIT|ROLLBACK)\s*;?\s*$
    | (VACUUM|ANALYZE)(\s+\w+)?\s*;?\s*$ | EXPLAIN\s | (PREPARE|DEALLOCATE)\s+\w+ | COPY\s+\w+ | CALL\s+\w+\s*\(
    )""",
    re.X,
)


def _leading_text(node: ast.expr) -> str | None:
    """The start of a string argument: a constant, an f-string, or a concatenation."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return first.value if isinstance(first, ast.Constant) else ""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _leading_text(node.left)
    return None


def offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sqlalchemy"):
            found += [f"{where}: imports sqlalchemy's text" for a in node.names if a.name == "text"]
        elif (
            isinstance(node, ast.Attribute) and node.attr == "text" and ast.unparse(node.value) in ("sqlalchemy", "sa")
        ):
            found.append(f"{where}: uses sqlalchemy.text")
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in SENDS and node.args and _leading_text(node.args[0]) is not None:
                found.append(f"{where}: {name}() of SQL text {_leading_text(node.args[0])[:40]!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.match(node.value):
            found.append(f"{where}: SQL text {node.value[:40]!r}")
    return found


def test_no_module_outside_staleflow_db_sends_sql_text():
    files = [p for d in OUTSIDE for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50
    assert [o for p in files for o in offences(p)] == []


def test_the_check_finds_sql_text(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from sqlalchemy import text\n"
        "conn.execute(text('SELECT 1'))\n"
        "conn.exec_driver_sql(f'LISTEN {channel}')\n"
        "Q = 'UPDATE runs SET version = 1'\n"
    )
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = offences(bad)
    finally:
        ROOT = root
    assert {int(f.split(":")[1]) for f in found} == {1, 2, 3, 4}, found
