"""Settings from the environment and URL normalisation (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow_db.settings import Settings, get_settings, to_libpq_url, to_sqlalchemy_url

ENV = (
    "STALEFLOW_DATABASE_URL",
    "STALEFLOW_HOME",
    "STALEFLOW_STATEMENT_TIMEOUT",
    "STALEFLOW_LOCK_TIMEOUT",
    "STALEFLOW_IDLE_IN_TRANSACTION_TIMEOUT",
    "STALEFLOW_POOL_SIZE",
    "STALEFLOW_MAX_OVERFLOW",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults(clean_env: pytest.MonkeyPatch) -> None:
    s = get_settings()
    assert s.database_url is None
    assert s.home == Path("~/.staleflow").expanduser()
    assert s.pgdata == s.home / "pgdata"
    assert (s.statement_timeout, s.lock_timeout, s.idle_in_transaction_session_timeout) == ("30s", "10s", "60s")
    assert s.pool_size > 0


def test_from_env(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("STALEFLOW_DATABASE_URL", "postgresql+psycopg://u@h:5433/d")
    clean_env.setenv("STALEFLOW_HOME", str(tmp_path))
    clean_env.setenv("STALEFLOW_STATEMENT_TIMEOUT", "500ms")
    clean_env.setenv("STALEFLOW_LOCK_TIMEOUT", "0")
    clean_env.setenv("STALEFLOW_POOL_SIZE", "3")
    s = get_settings()
    assert s.database_url == "postgresql://u@h:5433/d"  # kept in libpq form
    assert s.home == tmp_path and s.pgdata == tmp_path / "pgdata"
    assert (s.statement_timeout, s.lock_timeout, s.pool_size) == ("500ms", "0", 3)


@pytest.mark.parametrize("bad", ["30s -c fsync=off", "soon", "-1"])
def test_timeout_values_are_validated(clean_env: pytest.MonkeyPatch, bad: str) -> None:
    clean_env.setenv("STALEFLOW_STATEMENT_TIMEOUT", bad)
    with pytest.raises(ValueError, match="STALEFLOW_STATEMENT_TIMEOUT"):
        get_settings()


def test_bad_integer(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("STALEFLOW_POOL_SIZE", "many")
    with pytest.raises(ValueError, match="STALEFLOW_POOL_SIZE"):
        Settings.from_env()


@pytest.mark.parametrize(
    ("url", "sa", "libpq"),
    [
        ("postgresql://u@h/d", "postgresql+psycopg://u@h/d", "postgresql://u@h/d"),
        ("postgres://u@h/d", "postgresql+psycopg://u@h/d", "postgres://u@h/d"),
        ("postgresql+psycopg://u@h/d", "postgresql+psycopg://u@h/d", "postgresql://u@h/d"),
        ("postgresql+psycopg2://u@h/d", "postgresql+psycopg2://u@h/d", "postgresql://u@h/d"),
    ],
)
def test_url_forms(url: str, sa: str, libpq: str) -> None:
    assert to_sqlalchemy_url(url) == sa
    assert to_libpq_url(url) == libpq
