"""Where the database is, and engines to reach it."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy import pool as sa_pool
from sqlalchemy.engine import make_url

from staleflow_db import arrays, queries
from staleflow_db.settings import Settings, get_settings, to_libpq_url, to_sqlalchemy_url

CONNECT_TIMEOUT_S = 5


class _ResetOfALostConnection(logging.Filter):
    """SQLAlchemy's pool rolls a connection back when it is returned and, if that fails, logs
    "Exception during reset or similar" with a traceback and drops the connection. When the
    backend is gone (terminated, restarted) that is expected and said in one line; any other
    failure keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.msg == "Exception during reset or similar" and isinstance(exc, psycopg.OperationalError):
            record.msg = "pooled connection lost (%s); dropped from the pool"
            record.args = (str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


# Each pool class logs under its own name (sqlalchemy.pool.impl.QueuePool, ...): a logger's
# filter sees only the records logged to that very logger.
for _cls in (sa_pool.QueuePool, sa_pool.NullPool, sa_pool.StaticPool, sa_pool.SingletonThreadPool):
    logging.getLogger(f"{_cls.__module__}.{_cls.__name__}").addFilter(_ResetOfALostConnection())


def database_url(settings: Settings | None = None) -> str:
    """libpq URL of the StaleFlow database.

    ``STALEFLOW_DATABASE_URL`` if set; otherwise the embedded server under
    ``$STALEFLOW_HOME``, started (or reused) on the way and left running for the
    other processes.
    """
    settings = settings or get_settings()
    if settings.database_url:
        return settings.database_url
    from staleflow_db.embedded import EmbeddedPostgres  # only when it is needed

    return EmbeddedPostgres(settings.home).ensure_running()


def with_database(url: str, database: str) -> str:
    """The same server and credentials, another database."""
    return make_url(url).set(database=database).render_as_string(hide_password=False)


def session_options(settings: Settings | None = None) -> str:
    """libpq ``options``: per-connection timeouts, so no session can hang forever on a
    lock or sit idle in a transaction holding one; how prepared statements are planned."""
    s = settings or get_settings()
    return (
        f"-c statement_timeout={s.statement_timeout}"
        f" -c lock_timeout={s.lock_timeout}"
        f" -c idle_in_transaction_session_timeout={s.idle_in_transaction_session_timeout}"
        f" -c plan_cache_mode={s.plan_cache_mode}"
    )


def make_engine(url: str | None = None, *, settings: Settings | None = None, **kw: Any) -> Engine:
    """A pooled SQLAlchemy engine on the psycopg 3 driver.

    ``url`` defaults to :func:`database_url`; keyword arguments override the defaults
    and go to ``create_engine`` (``connect_args`` are merged, not replaced).
    """
    settings = settings or get_settings()
    url = to_sqlalchemy_url(url or database_url(settings))
    # A connect timeout, so a database that is down (or a host that drops packets) is a prompt
    # error the caller can retry, not a process hung in connect().
    connect_args: dict[str, Any] = {
        "options": session_options(settings),
        "application_name": "staleflow",
        "connect_timeout": CONNECT_TIMEOUT_S,
    }
    if not settings.prepared_statements:  # a transaction-mode pooler: any server connection next time
        connect_args["prepare_threshold"] = None
    connect_args.update(kw.pop("connect_args", {}))
    # Pre-ping: after a database restart every pooled connection is dead; the first checkout
    # notices, and SQLAlchemy then invalidates the whole pool, so one failed ping (not one per
    # stale connection) is the price of an outage.
    opts: dict[str, Any] = {"pool_pre_ping": True}
    if "poolclass" not in kw:  # sizes are only valid for the default QueuePool
        opts.update(pool_size=settings.pool_size, max_overflow=settings.max_overflow)
    opts.update(kw)
    engine = create_engine(url, connect_args=connect_args, **opts)
    event.listen(engine, "connect", lambda conn, _record: arrays.register(conn))  # cheaper list parameters
    return engine


def ping(conn: Connection) -> None:
    """A round trip on `conn`: raises if the database is not there."""
    conn.execute(queries.text("ping"))


__all__ = [
    "database_url",
    "make_engine",
    "ping",
    "session_options",
    "with_database",
    "to_libpq_url",
    "to_sqlalchemy_url",
]
