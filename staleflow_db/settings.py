"""Settings of the data layer, on the database-free base of workers/settings.py (the rules
every settings class follows are described there).

URLs: StaleFlow passes libpq URLs (``postgresql://user@host:port/db``) around, because
psycopg, psql and pgbench all take them; ``to_sqlalchemy_url`` converts at the SQLAlchemy
boundary (engine, Alembic) so the psycopg 3 driver is used rather than psycopg2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from workers.settings import PREFIX, HomeSettings, SettingsError, StaleFlowSettings, env_name, load

# Re-exported: importers of the base from here keep working.
__all__ = [
    "PREFIX",
    "Duration",
    "HomeSettings",
    "Settings",
    "SettingsError",
    "StaleFlowSettings",
    "env_name",
    "get_settings",
    "load",
    "to_libpq_url",
    "to_sqlalchemy_url",
]

_TIMEOUT_RE = re.compile(r"^\d+\s*(ms|s|min|h|d)?$")


def _duration(value: str) -> str:
    # These values end up in a libpq `options` string: reject anything that could smuggle
    # extra `-c` switches in.
    value = value.strip()
    if not _TIMEOUT_RE.match(value):
        raise ValueError("expected a PostgreSQL duration like 30s, 500ms or 0")
    return value.replace(" ", "")


Duration = Annotated[str, AfterValidator(_duration)]


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


class Settings(HomeSettings):
    """The database: which server, and the per-connection limits of every engine."""

    # Unset means "use the embedded server under `home`". Kept in libpq form.
    database_url: str | None = None
    # Where the API's LISTEN connection goes (session-level: it cannot pass a transaction-mode
    # pooler such as PgBouncer's); unset: `database_url`. docs/scaling.md, "Connection pooling".
    listen_database_url: str | None = None
    # Server-side prepared statements (psycopg's prepare_threshold, the driver's pipelines).
    # Off behind a transaction-mode PgBouncer older than 1.21 or without max_prepared_statements.
    prepared_statements: bool = True
    # How PostgreSQL plans prepared statements (its plan_cache_mode). One generic plan each:
    # `auto` re-planned most fast-path statements on nearly every call (planning was a third
    # of their time); tests/db/test_statement_plans.py checks the generic plans on a backlog.
    plan_cache_mode: Literal["auto", "force_generic_plan", "force_custom_plan"] = "force_generic_plan"
    statement_timeout: Duration = "30s"
    lock_timeout: Duration = "10s"
    idle_in_transaction_session_timeout: Duration = Field(
        "60s", validation_alias="STALEFLOW_IDLE_IN_TRANSACTION_TIMEOUT"
    )
    pool_size: int = Field(10, ge=0)
    # -1: no limit (SQLAlchemy's convention).
    max_overflow: int = Field(10, ge=-1)
    # Where `staleflow offload` moves finished segments' payloads (staleflow_db/payload_store.py):
    # a file:// folder or s3://bucket/prefix; unset: file://<home>/payloads. The endpoint of an
    # S3-compatible store other than AWS's (MinIO, Ceph, moto ...).
    payload_store: str | None = None
    payload_store_endpoint: str | None = None

    @field_validator("database_url", "listen_database_url")
    @classmethod
    def _libpq(cls, url: str | None) -> str | None:
        url = (url or "").strip()
        return to_libpq_url(url) if url else None

    @property
    def pgdata(self) -> Path:
        return self.home / "pgdata"

    @classmethod
    def from_env(cls) -> Settings:
        return load(cls)


def get_settings() -> Settings:
    """The database settings of the current environment (cached per environment)."""
    return load(Settings)
