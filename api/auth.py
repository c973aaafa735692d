"""Bearer tokens: random 32-byte secrets, stored as sha256 hashes with a role and an optional run.

A token without a run is valid for every run. `admin` may do everything (within its run, if
it has one); every other role is allowed only the endpoints that name it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from staleflow_db import tokens
from staleflow_db.errors import InvalidInput
from staleflow_db.tokens import OtherRun
from workers.wire.enums import Role

__all__ = ["OtherRun"]  # raised by revoke_token; the routers catch it as auth.OtherRun

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
    row = tokens.insert(engine, hash_token(token), role.value, run_id, name)
    return {**row, "token": token}


def list_tokens(engine: Engine, run_id: int | None = None) -> list[dict[str, Any]]:
    return tokens.listed(engine, run_id)


def revoke_token(engine: Engine, token_id: int, run_id: int | None = None) -> bool:
    """True if this call revoked it; False if it was revoked already. `run_id`: the caller's
    scope (None: every run); a token of another run is `OtherRun` (403)."""
    return tokens.revoke(engine, token_id, run_id)


def token_valid(engine: Engine, token: str) -> bool:
    return tokens.valid(engine, hash_token(token))


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
        row = tokens.principal(self.engine, h)
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


# The parameter-server keys a role's token receives (workers/trainer/param_auth.py): the PS
# itself runs with a trainer (or admin) token, as it must verify both roles.
PS_KEY_ROLES = {
    Role.ADMIN: (Role.TRAINER, Role.ROLLOUT),
    Role.TRAINER: (Role.TRAINER, Role.ROLLOUT),
    Role.ROLLOUT: (Role.ROLLOUT,),
}


def ps_keys(run_secret: bytes, run_id: int, role: Role) -> dict[str, str]:
    """The run's PS keys for a token of `role` (hex), each HMAC(run secret, run and key's role),
    so a rollout key reveals nothing of the trainer's."""
    return {
        r.value: hmac.new(run_secret, f"staleflow-ps key|{run_id}|{r.value}".encode(), hashlib.sha256).hexdigest()
        for r in PS_KEY_ROLES.get(role, ())
    }


def check_role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidInput(f"unknown role {role!r} (one of {', '.join(r.value for r in Role)})") from None
