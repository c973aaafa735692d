"""Schema migrations through Alembic's Python API.

The migrations are found from the imported package, so the functions work from any
working directory: in an installed wheel they are the package data
``staleflow_db/migrations`` (mapped from the top-level ``migrations/``, see pyproject);
in a checkout or editable install they are ``migrations/`` beside the package, with the
repository's ``alembic.ini``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import pool

from staleflow_db.settings import to_libpq_url, to_sqlalchemy_url

PACKAGE_DIR = Path(str(files("staleflow_db")))
REPO_ROOT = PACKAGE_DIR.parent


def migrations_dir() -> Path:
    """The wheel's package data first: it belongs to this very package, while a
    `migrations/` beside an installed package could be anyone's."""
    for candidate in (PACKAGE_DIR / "migrations", REPO_ROOT / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(f"no migrations in {PACKAGE_DIR} or {REPO_ROOT}: a broken installation")


def alembic_config(url: str | None = None) -> Config:
    script_location = migrations_dir()
    ini = script_location.parent / "alembic.ini"  # in a checkout only
    cfg = Config(str(ini)) if ini.is_file() else Config()
    cfg.set_main_option("script_location", str(script_location))
    cfg.set_main_option("path_separator", "os")  # as alembic.ini says; silences alembic's warning without one
    cfg.attributes["configure_logging"] = False
    if url:
        # configparser would read '%' (e.g. in a percent-encoded password) as interpolation.
        cfg.set_main_option("sqlalchemy.url", to_sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head() -> str | None:
    """The newest revision in ``migrations/versions``; None while there is none."""
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) > 1:
        raise RuntimeError(f"several migration heads {heads}: merge them")
    return heads[0] if heads else None


def current(url: str) -> str | None:
    """The revision the database is at; None for an unmigrated database."""
    from staleflow_db.db import make_engine

    engine = make_engine(to_libpq_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
