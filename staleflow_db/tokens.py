"""The API's bearer tokens as stored: sha256 hashes with a role and an optional run (the
secrets and their hashing are the API's, `api/auth.py`). Named queries: `sql/auth/tokens.sql`."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from . import queries
from .errors import NotFound


class OtherRun(Exception):
    """A run-scoped caller reached for something of another run (403)."""


def insert(engine: Engine, token_hash: str, role: str, run_id: int | None, name: str | None) -> dict[str, Any]:
    """Store a token; its row (id, role, run_id, name, created_at, revoked_at). An unknown
    `run_id` is NotFound."""
    with engine.begin() as c:
        if run_id is not None and c.execute(queries.text("token_run_exists"), {"r": run_id}).first() is None:
            raise NotFound(f"run {run_id}")
        row = c.execute(
            queries.text("token_create"), {"h": token_hash, "role": role, "run": run_id, "name": name}
        ).one()
    return dict(row._mapping)


def listed(engine: Engine, run_id: int | None = None) -> list[dict[str, Any]]:
    """Every token's row (only `run_id`'s, when given), by id."""
    with engine.connect() as c:
        rows = c.execute(queries.text("token_list"), {"run": run_id}).all()
    return [dict(r._mapping) for r in rows]


def revoke(engine: Engine, token_id: int, run_id: int | None = None) -> bool:
    """True if this call revoked it; False if it was revoked already. `run_id`: the caller's
    scope (None: every run); a token of another run is OtherRun."""
    with engine.begin() as c:
        row = c.execute(queries.text("token_lock"), {"i": token_id}).first()
        if row is None:
            raise NotFound(f"token {token_id}")
        if run_id is not None and row.run_id != run_id:
            raise OtherRun(f"token {token_id} is not of run {run_id}")
        if row.revoked_at is not None:
            return False
        c.execute(queries.text("token_revoke"), {"i": token_id})
        return True


def valid(engine: Engine, token_hash: str) -> bool:
    """Whether a token with this hash exists and is not revoked."""
    with engine.connect() as c:
        return c.execute(queries.text("token_valid"), {"h": token_hash}).first() is not None


def principal(engine: Engine, token_hash: str) -> tuple[int, str, int | None] | None:
    """(id, role, run_id) of the live token with this hash; None for an unknown or revoked one."""
    with engine.connect() as c:
        row = c.execute(queries.text("token_principal"), {"h": token_hash}).first()
    return None if row is None else (row.id, row.role, row.run_id)
