"""Settings read from the environment.

URLs: StaleFlow passes libpq URLs (``postgresql://user@host:port/db``) around, because
psycopg, psql and pgbench all take them; ``to_sqlalchemy_url`` converts at the SQLAlchemy
boundary (engine, Alembic) so the psycopg 3 driver is used rather than psycopg2.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_TIMEOUT_RE = re.compile(r"^\d+\s*(ms|s|min|h|d)?$")


def _timeout(env: str, default: str) -> str:
    value = os.environ.get(env, default).strip()
    # These values end up in a libpq `options` string: reject anything that could
    # smuggle extra `-c` switches in.
    if not _TIMEOUT_RE.match(value):
        raise ValueError(f"{env}={value!r}: expected a PostgreSQL duration like 30s, 500ms or 0")
    return value.replace(" ", "")


def _int(env: str, default: int) -> int:
    raw = os.environ.get(env)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r}: expected an integer") from None


def to_sqlalchemy_url(url: str) -> str:
    """``postgresql://`` / ``postgres://`` -> ``postgresql+psycopg://``; other drivers kept."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def to_libpq_url(url: str) -> str:
    """Inverse of :func:`to_sqlalchemy_url`: a URL psycopg.connect / psql accept."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.startswith(("postgresql+", "postgres+")):
        return "postgresql://" + rest
    return url


@dataclass(frozen=True)
class Settings:
    # None means "use the embedded server under `home`".
    database_url: str | None = None
    home: Path = field(default_factory=lambda: Path("~/.staleflow").expanduser())
    statement_timeout: str = "30s"
    lock_timeout: str = "10s"
    idle_in_transaction_session_timeout: str = "60s"
    pool_size: int = 10
    max_overflow: int = 10

    @property
    def pgdata(self) -> Path:
        return self.home / "pgdata"

    @classmethod
    def from_env(cls) -> Settings:
        url = os.environ.get("STALEFLOW_DATABASE_URL", "").strip() or None
        home = os.environ.get("STALEFLOW_HOME", "").strip() or "~/.staleflow"
        return cls(
            database_url=to_libpq_url(url) if url else None,
            home=Path(home).expanduser().absolute(),
            statement_timeout=_timeout("STALEFLOW_STATEMENT_TIMEOUT", "30s"),
            lock_timeout=_timeout("STALEFLOW_LOCK_TIMEOUT", "10s"),
            idle_in_transaction_session_timeout=_timeout("STALEFLOW_IDLE_IN_TRANSACTION_TIMEOUT", "60s"),
            pool_size=_int("STALEFLOW_POOL_SIZE", 10),
            max_overflow=_int("STALEFLOW_MAX_OVERFLOW", 10),
        )


def get_settings() -> Settings:
    """Fresh read each call: cheap, and tests can change the environment freely."""
    return Settings.from_env()
