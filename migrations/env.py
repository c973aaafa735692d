"""Alembic environment for StaleFlow (online mode only: migrations need a live server).

The URL comes from the config's ``sqlalchemy.url`` when staleflow_db.migrate set it,
else from ``staleflow_db.db.database_url()``. A caller may also hand over an open
connection in ``config.attributes["connection"]`` to migrate inside its transaction.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import pool

from staleflow_db.db import database_url, make_engine
from staleflow_db.settings import to_libpq_url

config = context.config

# The plain `alembic` CLI wants the ini's logging; migrate.py turns it off so a library
# call does not reconfigure the host process's loggers.
if config.config_file_name and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _target_metadata():
    # Imported here, not at module top: migrations must stay runnable while the schema
    # module is being written. Only a missing schema module is tolerated.
    try:
        from staleflow_db.schema import metadata
    except ModuleNotFoundError as err:
        if err.name != "staleflow_db.schema":
            raise
        return None
    return metadata


target_metadata = _target_metadata()


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or database_url()
    # One-shot engine. DDL on a big table may rightly run long, so no statement
    # timeout; the lock timeout stays, so a migration stuck behind a busy table fails
    # rather than blocking every query queued behind its lock request.
    engine = make_engine(
        to_libpq_url(url),
        poolclass=pool.NullPool,
        connect_args={"options": "-c statement_timeout=0 -c lock_timeout=60s"},
    )
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("StaleFlow migrations run online only (no --sql mode)")
run_migrations_online()
