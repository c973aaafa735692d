"""Schema migrations through Alembic's Python API.

The repository's ``alembic.ini`` and ``migrations/`` are found from this file's
location (they sit beside the package in a checkout or editable install), so the
functions work from any working directory.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import pool

from staleflow_db.settings import to_libpq_url, to_sqlalchemy_url

REPO_ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS_DIR = REPO_ROOT / "migrations"
ALEMBIC_INI = REPO_ROOT / "alembic.ini"


def alembic_config(url: str | None = None) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(
            f"no migrations at {MIGRATIONS_DIR}: StaleFlow must run from a checkout "
            "(pip install -e .), not a plain wheel install"
        )
    cfg = Config(str(ALEMBIC_INI)) if ALEMBIC_INI.is_file() else Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
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
