"""Named queries: every SQL statement of the data layer, loaded once from `staleflow_db/sql/`.

The convention (as aiosql, sqlc and procrastinate write it):

- One `.sql` file per capability (`rollout.sql`, `scoring.sql`, `auth/tokens.sql` ...). Each
  statement follows a header line `-- name: <name>`; comment lines right after the header
  describe it. Names are unique across all files: a duplicate fails the import, an unknown
  name fails the call (`UnknownQuery`).
- One placeholder style, SQLAlchemy's `:name`. A parameter whose type PostgreSQL cannot infer
  carries its cast in the SQL (`CAST(:ids AS bigint[])`), so the statement means the same
  whoever sends it: SQLAlchemy (`text(name)`), psycopg directly (`pyformat(name)`, the
  pipelined locked reads of `protocol.driver`), or `PREPARE` (`positional(sql)`, the tests).
- No statement is generated: lists are arrays (`= ANY(:ids)`, `unnest`), optional filters are
  separate statements or `:x IS NULL OR ...`. A statement assembled at run time from optional
  parts (the run lock's flush, a segment report: only the parts with something to write, as
  CTEs of one statement) is composed from named statements by `with_parts`, each part kept
  with its capability (route's writes in rollout.sql, Occupy's in scoring.sql), and says why
  where it is composed.
- Full-line and trailing `--` comments are dropped and the lines joined with single spaces:
  what is sent is one line. A statement with a dollar-quoted body (`$$`: a function) is kept
  as written, since PostgreSQL stores its source.
- DDL (views and functions) lives here too, under names starting with `view_` / `function_`:
  `ddl()` lists them, and the migrations apply them (migration 0008; a change to one edits
  the file, freezes the replaced definition as `*_v<N>.sql`, and adds a migration that applies
  them again, as 0008's `apply_named_ddl` does).

Files named `*_v<N>.sql` are frozen DDL that an old migration reads by file name (0002's
`audit_v2.sql`, 0007's `audit_lineage_v1.sql`); they are history, not named queries.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from sqlalchemy import TextClause
from sqlalchemy import text as sa_text

SQL_DIR = Path(str(files("staleflow_db"))) / "sql"
HEADER = re.compile(r"^--\s*name:\s*(\S+)\s*$")
NAME = re.compile(r"^[a-z][a-z0-9_]*$")
FROZEN = re.compile(r".*_v\d+\.sql$")
# a bind parameter as SQLAlchemy's text() finds it: not a `::` cast, not inside a word
BIND = re.compile(r"(?<![:\w\\]):([A-Za-z_]\w*)(?!:)")


class UnknownQuery(KeyError):
    pass


@dataclass(frozen=True)
class Query:
    name: str
    sql: str  # with :name parameters
    file: str  # relative to SQL_DIR

    @property
    def is_ddl(self) -> bool:
        return self.name.startswith(("view_", "function_"))

    @property
    def params(self) -> list[str]:
        """Its parameters' names, in order of first appearance."""
        return list(dict.fromkeys(BIND.findall(self.sql)))


def _strip_comment(line: str) -> str:
    """The line without a trailing `--` comment (one outside a string literal)."""
    quoted = False
    for i, ch in enumerate(line):
        if ch == "'":
            quoted = not quoted
        elif not quoted and line.startswith("--", i):
            return line[:i]
    return line


def _statement(lines: Sequence[str]) -> str:
    lines = list(lines)
    while lines and (not lines[0].strip() or lines[0].strip().startswith("--")):
        lines.pop(0)  # the header's description
    body = "\n".join(lines).strip()
    if "$$" in body:
        return body.rstrip(";").rstrip()
    code = (_strip_comment(line).strip() for line in lines)
    return " ".join(c for c in code if c).rstrip(";").rstrip()


def parse(source: str, file: str) -> list[Query]:
    """The named statements of one file. Text before the first header must be comments."""
    found: list[Query] = []
    name: str | None = None
    lines: list[str] = []

    def close() -> None:
        if name is not None:
            sql = _statement(lines)
            if not sql:
                raise ValueError(f"{file}: query {name!r} is empty")
            found.append(Query(name, sql, file))

    for n, line in enumerate(source.splitlines(), 1):
        m = HEADER.match(line.strip())
        if m:
            close()
            name, lines = m.group(1), []
            if not NAME.match(name):
                raise ValueError(f"{file}:{n}: query name {name!r} is not lower_snake_case")
        elif name is None:
            if line.strip() and not line.strip().startswith("--"):
                raise ValueError(f"{file}:{n}: SQL before the first '-- name:' header")
        else:
            lines.append(line)
    close()
    return found


def load(directory: Path = SQL_DIR) -> dict[str, Query]:
    queries: dict[str, Query] = {}
    for path in sorted(directory.rglob("*.sql")):
        if FROZEN.match(path.name):
            continue
        rel = path.relative_to(directory).as_posix()
        for q in parse(path.read_text(encoding="utf-8"), rel):
            if q.name in queries:
                raise ValueError(f"query {q.name!r} is defined in {queries[q.name].file} and again in {rel}")
            queries[q.name] = q
    return queries


QUERIES: Mapping[str, Query] = load()


def get(name: str) -> Query:
    try:
        return QUERIES[name]
    except KeyError:
        raise UnknownQuery(f"no named query {name!r} in {SQL_DIR}") from None


def sql(name: str) -> str:
    """The statement as written (`:name` parameters)."""
    return get(name).sql


@functools.cache
def text(name: str) -> TextClause:
    """The statement for `Connection.execute`, built once."""
    return sa_text(get(name).sql)


def to_pyformat(statement: str) -> str:
    """`:name` parameters as psycopg's `%(name)s` (a literal `%` doubled)."""
    return BIND.sub(r"%(\1)s", statement.replace("%", "%%"))


@functools.cache
def pyformat(name: str) -> str:
    """The statement for psycopg's own `execute` (`protocol.driver`), converted once."""
    return to_pyformat(get(name).sql)


def positional(statement: str) -> tuple[str, list[str]]:
    """`:name` parameters as `$1, $2 ...` in order of first appearance (for PREPARE), and
    the names in that order."""
    order: dict[str, int] = {}

    def number(m: re.Match[str]) -> str:
        return f"${order.setdefault(m.group(1), len(order) + 1)}"

    return BIND.sub(number, statement), list(order)


@functools.cache  # the flush renames its parts on every run-locked call
def prefixed(name: str, prefix: str) -> str:
    """The statement with every parameter renamed `<prefix><name>`: a part of a larger
    statement (`with_parts`) whose parameters must not meet another part's."""
    return BIND.sub(lambda m: f":{prefix}{m.group(1)}", get(name).sql)


def with_parts(parts: Iterable[str], final: str) -> str:
    """`final` after the data-modifying `parts` as CTEs w0, w1 ...: one statement, one round
    trip. The parts must touch disjoint rows (they share one snapshot)."""
    ctes = ", ".join(f"w{i} AS ({part})" for i, part in enumerate(parts))
    return f"WITH {ctes} {final}" if ctes else final


@functools.lru_cache(maxsize=256)
def composed(statement: str) -> TextClause:
    """A statement composed at run time (`with_parts`), built once per distinct text."""
    return sa_text(statement)


@functools.lru_cache(maxsize=256)
def composed_pyformat(statement: str) -> str:
    """A statement composed at run time in psycopg's form (`protocol.driver`), built once per
    distinct text."""
    return to_pyformat(statement)


def ddl() -> list[Query]:
    """The views and functions, in file order (a view after what it selects from)."""
    return [q for q in QUERIES.values() if q.is_ddl]


def ddl_statements(frozen_views: str | None = None) -> list[str]:
    """What a migration applies: every named view and function; with `frozen_views` (a frozen
    `*_v<N>.sql` file), audit.sql's views as that file defines them instead, after the rest."""
    current = [q.sql for q in ddl() if frozen_views is None or q.file != "audit.sql"]
    if frozen_views is None:
        return current
    return current + [q.sql for q in parse((SQL_DIR / frozen_views).read_text(encoding="utf-8"), frozen_views)]
