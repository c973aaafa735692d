"""``staleflow db ...``: the database behind StaleFlow."""

from __future__ import annotations

import typer
from rich.console import Console

from staleflow_db import migrate
from staleflow_db.db import database_url
from staleflow_db.embedded import EmbeddedPostgres
from staleflow_db.settings import get_settings

app = typer.Typer(help="Database: URL, migrations, the embedded server.", no_args_is_help=True)
err = Console(stderr=True)


@app.command()
def url() -> None:
    """Print the database URL (starts the embedded server if needed and leaves it running)."""
    print(database_url())


@app.command()
def upgrade(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Migrate the database to the newest schema (or REVISION)."""
    target = database_url()
    before = migrate.current(target)
    err.print(f"database: {target}\nschema before: {before or '(empty)'}")
    if migrate.head() is None:
        err.print("no migrations exist yet; nothing to do")
        return
    migrate.upgrade(target, revision)
    after = migrate.current(target)
    if after == before:
        print(f"already at {after}")
    else:
        print(f"upgraded {before or '(empty)'} -> {after}")


@app.command()
def stop() -> None:
    """Stop the embedded server under $STALEFLOW_HOME (no-op with STALEFLOW_DATABASE_URL)."""
    settings = get_settings()
    if settings.database_url:
        err.print("STALEFLOW_DATABASE_URL is set: that server is not ours to stop")
    if EmbeddedPostgres(settings.home).stop():
        print(f"stopped embedded PostgreSQL in {settings.pgdata}")
    else:
        print(f"embedded PostgreSQL in {settings.pgdata} was not running")


@app.command()
def status() -> None:
    """Show which database is in use, whether it is up, and its schema revision.

    Starts nothing.
    """
    settings = get_settings()
    emb = EmbeddedPostgres(settings.home).status()
    target: str | None
    if settings.database_url:
        print("source:    STALEFLOW_DATABASE_URL")
        target = settings.database_url
    else:
        print(f"source:    embedded server ({emb['pgdata']})")
        print(f"running:   {'yes, pid {}, port {}'.format(emb['pid'], emb['port']) if emb['running'] else 'no'}")
        target = emb["url"] if isinstance(emb["url"], str) else None  # None while stopped
    print(f"url:       {target or '-'}")
    head = migrate.head()
    print(f"head:      {head or '(no migrations)'}")
    if target:
        try:
            rev = migrate.current(target)
        except Exception as exc:  # report, don't crash: status is for diagnosis
            print(f"schema:    unreachable ({type(exc).__name__}: {str(exc).splitlines()[0]})")
            raise typer.Exit(1) from None
        state = "up to date" if rev == head else "needs `staleflow db upgrade`"
        print(f"schema:    {rev or '(empty)'} ({state})")
