"""Every statement sent while a block runs, the protocol driver's pipelines included."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from staleflow_db.protocol import driver


@contextmanager
def recording(target: Any, record: Callable[[Any, str, Any], None]) -> Iterator[None]:
    """Call `record(connection, statement, parameters)` for each statement `target` (an engine,
    or the Engine class: every engine) sends while the block runs, and for each statement of a
    pipeline sent on a psycopg connection itself (`protocol.driver`; its parameters as a dict).
    An executemany's parameters are a list."""

    def hook(conn, cursor, statement, parameters, context, executemany):
        record(conn, statement, parameters)

    results = driver.results

    def pipelined(conn, statements, row_factory):
        for sql, params in statements:
            record(conn, sql, dict(params))
        return results(conn, statements, row_factory)

    event.listen(target, "before_cursor_execute", hook)
    driver.results = pipelined
    try:
        yield
    finally:
        driver.results = results
        event.remove(target, "before_cursor_execute", hook)


@contextmanager
def sent_with_autocommit(engine: Any) -> Iterator[list[tuple[str, bool]]]:
    """(statement, whether its connection was in autocommit) for each statement the engine
    sends while the block runs (a long-poll's idle re-check is a read in autocommit)."""
    out: list[tuple[str, bool]] = []

    def record(conn: Any, statement: str, parameters: Any) -> None:
        out.append((statement, bool(conn.connection.driver_connection.autocommit)))

    with recording(engine, record):
        yield out
