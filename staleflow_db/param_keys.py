"""Each run's parameter-server secret as stored: 32 random bytes, created on first use (the
keys derived from it and who gets them are the API's, `api/auth.py`). Named queries:
`sql/auth/param_keys.sql`."""

from __future__ import annotations

import secrets

from sqlalchemy import Engine

from . import queries
from .errors import NotFound


def run_secret(engine: Engine, run_id: int) -> bytes:
    """The run's secret, created if it has none yet (concurrent callers get the same one).
    NotFound for an unknown run."""
    with engine.begin() as c:
        c.execute(queries.text("param_key_create"), {"r": run_id, "s": secrets.token_bytes(32)})
        # a new statement: sees a secret another transaction committed while this one waited
        row = c.execute(queries.text("param_key_get"), {"r": run_id}).first()
    if row is None:
        raise NotFound(f"run {run_id}")
    return bytes(row.secret)
