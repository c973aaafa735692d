"""Statements sent straight on the psycopg connection under a SQLAlchemy transaction: several
in one round trip (psycopg's pipeline mode), each planned once per connection (a prepared
statement), with errors raised as SQLAlchemy's own, as `Connection.execute` would raise them.

Why: the run-locked calls used to send their locking read through `staleflow_lock_run_read`
(migration 0005), whose EXECUTE plans the read on every call: 0.6-0.8 ms of planning while
every other run-locked call waits, as much as the read itself at batch 16. Two statements in
one pipeline keep the single round trip, and a prepared read is planned once (its generic plan
reaches rows by index as the custom one did: `tests/db/test_locked_reads.py`).

The statements are named queries in psycopg's form (`queries.pyformat`): their parameters carry
their casts in the SQL (psycopg would otherwise send a list of small ints as smallint[])."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import psycopg.rows
from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc


class _SecondReportOfTheSameError(logging.Filter):
    """psycopg logs a pipeline's failure to close when its block already raised. On a lost
    connection that is the same loss again, once per pooled connection after an outage, while
    the block's error is raised to the caller and handled there (`scalars`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "error ignored terminating %r: %s" and args and isinstance(args[0], psycopg.Pipeline))


logging.getLogger("psycopg").addFilter(_SecondReportOfTheSameError())


def scalars(conn: Connection, statements: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Any]:
    """The one value each statement returns, the statements sent in one round trip and run one
    after another (each a statement of its own: under READ COMMITTED each takes its snapshot
    when it starts, so a read after a lock sees what the lock's previous holder committed)."""
    values = []
    for rows in results(conn, statements, psycopg.rows.tuple_row):
        values.append(rows[0][0] if rows else None)  # SAVEPOINT ... returns no rows
    return values


def rows(conn: Connection, statements: Sequence[tuple[str, Mapping[str, Any]]]) -> list[list[Any]]:
    """Every row of each statement (named tuples: columns as attributes), sent as `scalars`
    sends them: one round trip, one after another."""
    return results(conn, statements, psycopg.rows.namedtuple_row)


def results(conn: Connection, statements: Sequence[tuple[str, Mapping[str, Any]]], row_factory: Any) -> list[list[Any]]:
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    try:
        with raw.pipeline():
            # prepared unless the engine turned prepared statements off (STALEFLOW_PREPARED_STATEMENTS)
            prepare = raw.prepare_threshold is not None
            cursors = [
                raw.cursor(row_factory=row_factory).execute(sql, params, prepare=prepare) for sql, params in statements
            ]
        return [cur.fetchall() if cur.description is not None else [] for cur in cursors]
    except psycopg.Error as e:
        # as SQLAlchemy wraps a driver error: OperationalError, IntegrityError ... with `orig`,
        # so the retry on deadlocks and the outage handling see what they always saw; a
        # connection the error broke is invalidated, not handed back to the pool
        broken = raw.broken or raw.closed
        err = sa_exc.DBAPIError.instance(
            statements[-1][0], dict(statements[-1][1]), e, psycopg.Error, connection_invalidated=broken
        )
        if broken:
            conn.invalidate(e)
        raise err from e
