"""``staleflow token ...``: API tokens, managed straight in the database (for whoever holds
the database credentials; remote admins use POST /v1/tokens)."""

from __future__ import annotations

import typer

from api import auth
from staleflow_db.audit import find_run
from staleflow_db.db import make_engine
from staleflow_db.errors import NotFound

app = typer.Typer(help="API tokens: create, list, revoke.", no_args_is_help=True)


@app.command()
def create(
    role: str = typer.Option(
        ..., "--role", help="admin, rollout, reward, trainer, coordinator or observer (reads only: the dashboard)"
    ),
    run: str | None = typer.Option(None, "--run", help="limit the token to this run (id or name)"),
    name: str | None = typer.Option(None, "--name", help="a label to recognise it by"),
) -> None:
    """Print a new token (shown once: only its hash is stored)."""
    try:
        role_ = auth.check_role(role)
    except Exception as exc:
        raise typer.BadParameter(str(exc), param_hint="--role") from None
    engine = make_engine()
    try:
        run_id = find_run(engine, run) if run is not None else None
        print(auth.create_token(engine, role_, run_id, name)["token"])
    except NotFound as exc:
        raise typer.BadParameter(f"{exc} does not exist", param_hint="--run") from None
    finally:
        engine.dispose()


@app.command("list")
def list_() -> None:
    """Tokens (id, role, run, name, state) without their secrets."""
    engine = make_engine()
    try:
        for t in auth.list_tokens(engine):
            scope = "all runs" if t["run_id"] is None else f"run {t['run_id']}"
            state = "revoked" if t["revoked_at"] else "active"
            print(
                f"{t['id']}\t{t['role'].value if hasattr(t['role'], 'value') else t['role']}\t{scope}\t{state}\t{t['name'] or ''}"
            )
    finally:
        engine.dispose()


@app.command()
def revoke(token_id: int = typer.Argument(..., help="the id shown by `staleflow token list`")) -> None:
    """Revoke a token; API replicas refuse it within their token cache time (5 s)."""
    engine = make_engine()
    try:
        print("revoked" if auth.revoke_token(engine, token_id) else "already revoked")
    except NotFound:
        raise typer.BadParameter(f"no token {token_id}") from None
    finally:
        engine.dispose()
