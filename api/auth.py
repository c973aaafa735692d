"""Bearer tokens: random 32-byte secrets, stored as sha256 hashes with a role and an optional run.

A token without a run is valid for every run. `admin` may do everything (within its run, if
it has one); every other role is allowed only the endpoints that name it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

from staleflow_db.errors import InvalidInput, NotFound
from workers.wire.enums import Role

PREFIX = "sf_"


@dataclass(frozen=True)
class Principal:
    token_id: int
    role: Role
    run_id: int | None  # None: every run

    def may_use_run(self, run_id: int) -> bool:
        return self.run_id is None or self.run_id == run_id


def hash_token(token: str) -> str:
    # sha256 suffices: the secret has 256 random bits, so no dictionary or brute force applies.
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    engine: Engine, role: Role | str, run_id: int | None = None, name: str | None = None
) -> dict[str, Any]:
    role = Role(role)
    token = PREFIX + secrets.token_urlsafe(32)
    with engine.begin() as c:
        if run_id is not None and c.execute(text("SELECT 1 FROM runs WHERE id = :r"), {"r": run_id}).first() is None:
            raise NotFound(f"run {run_id}")
        row = c.execute(
            text(
                "INSERT INTO api_tokens (token_hash, role, run_id, name) VALUES (:h, CAST(:role AS token_role), :run, :name)"
                " RETURNING id, role, run_id, name, created_at, revoked_at"
            ),
            {"h": hash_token(token), "role": role.value, "run": run_id, "name": name},
        ).one()
    return {**row._mapping, "token": token}


def list_tokens(engine: Engine, run_id: int | None = None) -> list[dict[str, Any]]:
    where = "" if run_id is None else " WHERE run_id = :run"
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT id, role, run_id, name, created_at, revoked_at FROM api_tokens{where} ORDER BY id"),
            {"run": run_id},
        ).all()
    return [dict(r._mapping) for r in rows]


class OtherRun(Exception):
    """A run-scoped caller reached for something of another run (403)."""


def revoke_token(engine: Engine, token_id: int, run_id: int | None = None) -> bool:
    """True if this call revoked it; False if it was revoked already. `run_id`: the caller's
    scope (None: every run)."""
    with engine.begin() as c:
        row = c.execute(
            text("SELECT run_id, revoked_at FROM api_tokens WHERE id = :i FOR UPDATE"), {"i": token_id}
        ).first()
        if row is None:
            raise NotFound(f"token {token_id}")
        if run_id is not None and row[0] != run_id:
            raise OtherRun(f"token {token_id} is not of run {run_id}")
        if row[1] is not None:
            return False
        c.execute(text("UPDATE api_tokens SET revoked_at = now() WHERE id = :i"), {"i": token_id})
        return True


def token_valid(engine: Engine, token: str) -> bool:
    with engine.connect() as c:
        return (
            c.execute(
                text("SELECT 1 FROM api_tokens WHERE token_hash = :h AND revoked_at IS NULL"), {"h": hash_token(token)}
            ).first()
            is not None
        )


class TokenCache:
    """Token lookups cost a query; cache them briefly (misses too, so guessing costs no query)."""

    MAX_ENTRIES = 10_000

    def __init__(self, engine: Engine, ttl: float):
        self.engine, self.ttl = engine, ttl
        self._entries: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    def cached(self, token: str) -> tuple[bool, Principal | None]:
        """(True, principal or None) from the cache without I/O; (False, None) on a miss."""
        hit = self._entries.get(hash_token(token))
        if hit is not None and hit[0] > time.monotonic():
            return True, hit[1]
        return False, None

    def lookup(self, token: str) -> Principal | None:
        h = hash_token(token)
        now = time.monotonic()
        hit = self._entries.get(h)
        if hit is not None and hit[0] > now:
            return hit[1]
        with self.engine.connect() as c:
            row = c.execute(
                text("SELECT id, role, run_id FROM api_tokens WHERE token_hash = :h AND revoked_at IS NULL"), {"h": h}
            ).first()
        principal = None if row is None else Principal(row[0], Role(row[1]), row[2])
        with self._lock:
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()
            self._entries[h] = (now + self.ttl, principal)
        return principal

    def forget(self) -> None:
        with self._lock:
            self._entries.clear()


def ensure_local_token(engine: Engine, home: Path) -> Path:
    """The single-machine default: an admin token for the local user in `$STALEFLOW_HOME/token`
    (mode 0600), created on first use and re-created if the database no longer knows it."""
    path = home / "token"
    if path.is_file():
        token = path.read_text().strip()
        if token and token_valid(engine, token):
            return path
    token = create_token(engine, Role.ADMIN, None, "local user")["token"]
    home.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def check_role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidInput(f"unknown role {role!r} (one of {', '.join(r.value for r in Role)})") from None
