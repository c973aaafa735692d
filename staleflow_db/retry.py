"""Which database errors are outages, for the retry policies of workers/retry.py (where the
waits, the outage log and the other named policies live)."""

from __future__ import annotations

import psycopg
from sqlalchemy import exc as sa_exc

from workers import retry


def is_db_unavailable(exc: BaseException) -> bool:
    """The database cannot be reached or dropped us (server restarting, connection refused or
    killed, no pool connection free, lock/statement timeout): worth retrying. Constraint
    violations, bad SQL and protocol refusals are not."""
    if isinstance(exc, (sa_exc.DisconnectionError, sa_exc.TimeoutError)):
        return True
    if isinstance(exc, sa_exc.DBAPIError):
        return exc.connection_invalidated or isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError))
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


DATABASE_OUTAGE = retry.DATABASE_OUTAGE.but(retryable=is_db_unavailable)
"""Database work retried through outages of the database, for ever (or until `stopping`)."""
