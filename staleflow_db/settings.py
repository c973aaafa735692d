"""Settings of the data layer, and the base every StaleFlow settings class builds on.

Every setting is an environment variable with the ``STALEFLOW_`` prefix, validated by
pydantic-settings; docs/settings.md lists them all in one table (a unit test keeps it exact).
Empty variables count as unset. A bad value raises :class:`SettingsError` (a ``ValueError``)
naming the variable. ``get_settings()`` is cached per content of the ``STALEFLOW_*``
environment, so it is cheap to call anywhere and a test that changes the environment
(``monkeypatch.setenv``) sees its change without clearing anything; tests may also build a
class directly with keyword overrides (``Settings(database_url=...)``), which win over the
environment.

URLs: StaleFlow passes libpq URLs (``postgresql://user@host:port/db``) around, because
psycopg, psql and pgbench all take them; ``to_sqlalchemy_url`` converts at the SQLAlchemy
boundary (engine, Alembic) so the psycopg 3 driver is used rather than psycopg2.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PREFIX = "STALEFLOW_"
_TIMEOUT_RE = re.compile(r"^\d+\s*(ms|s|min|h|d)?$")


def _duration(value: str) -> str:
    # These values end up in a libpq `options` string: reject anything that could smuggle
    # extra `-c` switches in.
    value = value.strip()
    if not _TIMEOUT_RE.match(value):
        raise ValueError("expected a PostgreSQL duration like 30s, 500ms or 0")
    return value.replace(" ", "")


Duration = Annotated[str, AfterValidator(_duration)]


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable that sets `field` of `cls`."""
    alias = cls.model_fields[field].validation_alias
    if isinstance(alias, str):
        return alias
    return str(cls.model_config.get("env_prefix", "")).upper() + field.upper()


class SettingsError(ValueError):
    """Invalid settings: one line per bad variable, naming it and what it expects."""

    def __init__(self, cls: type[BaseSettings], exc: ValidationError):
        lines = []
        for err in exc.errors():
            loc = str(err["loc"][0]) if err["loc"] else ""
            name = env_name(cls, loc) if loc in cls.model_fields else loc  # else: an alias already
            raw = os.environ.get(name, err.get("input"))
            lines.append(f"{name}={raw!r}: {err['msg'].removeprefix('Value error, ')}")
        super().__init__("invalid settings:\n  " + "\n  ".join(lines))


class StaleFlowSettings(BaseSettings):
    """Base: ``STALEFLOW_`` variables, blanks ignored, immutable, errors that name the variable."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX,
        env_ignore_empty=True,
        frozen=True,
        extra="ignore",
        populate_by_name=True,
        validate_default=True,
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(type(self), exc) from None


S = TypeVar("S", bound=StaleFlowSettings)


@lru_cache(maxsize=64)
def _cached(cls: type[S], env: tuple[tuple[str, str], ...]) -> S:
    return cls()


def load(cls: type[S]) -> S:
    """`cls` as the current environment sets it, parsed once per distinct environment."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(PREFIX)))
    return _cached(cls, env)


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


class Settings(StaleFlowSettings):
    """The database: which server, and the per-connection limits of every engine."""

    # Unset means "use the embedded server under `home`". Kept in libpq form.
    database_url: str | None = None
    # Embedded server data (`pgdata/`), the local token file and trainer checkpoints.
    home: Path = Path("~/.staleflow")
    statement_timeout: Duration = "30s"
    lock_timeout: Duration = "10s"
    idle_in_transaction_session_timeout: Duration = Field(
        "60s", validation_alias="STALEFLOW_IDLE_IN_TRANSACTION_TIMEOUT"
    )
    pool_size: int = Field(10, ge=0)
    # -1: no limit (SQLAlchemy's convention).
    max_overflow: int = Field(10, ge=-1)

    @field_validator("database_url")
    @classmethod
    def _libpq(cls, url: str | None) -> str | None:
        url = (url or "").strip()
        return to_libpq_url(url) if url else None

    @field_validator("home")
    @classmethod
    def _absolute(cls, home: Path) -> Path:
        return home.expanduser().absolute()

    @property
    def pgdata(self) -> Path:
        return self.home / "pgdata"

    @classmethod
    def from_env(cls) -> Settings:
        return load(cls)


def get_settings() -> Settings:
    """The database settings of the current environment (cached per environment)."""
    return load(Settings)
