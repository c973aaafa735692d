"""The ``staleflow`` command.

Each command group lives in its own module exporting a ``typer.Typer`` (or one command
function) and is registered below with one line of COMMANDS; keep this root small.

Commands are imported when run (or listed by ``--help``), not all up front: a worker node's
install (``staleflow[worker]``, without the database and API stack) runs ``rollout-worker``,
``reward-worker``, ``trainer`` ... and the server's commands say which extra they need.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from workers.extras import missing_extra

# name -> "module:attribute", a typer.Typer (a command group) or a command function, in the
# order `staleflow --help` lists them.
COMMANDS = {
    "serve": "staleflow_cli.serve:serve",
    "audit": "staleflow_cli.audit:audit",
    "lineage": "staleflow_cli.lineage:lineage",
    "export": "staleflow_cli.export:export",
    "replay": "staleflow_cli.replay:replay",
    "offload": "staleflow_cli.offload:offload",
    "coordinator": "staleflow_cli.coordinator:coordinator",
    "demo": "staleflow_cli.demo:demo",
    "run": "staleflow_cli.runs:app",
    "enqueue": "staleflow_cli.enqueue:enqueue",
    "trainer": "staleflow_cli.trainer:trainer",
    "ps": "staleflow_cli.trainer:ps",
    "rollout-worker": "staleflow_cli.rollout:rollout_worker",
    "reward-worker": "staleflow_cli.reward:reward_worker",
    "db": "staleflow_cli.db:app",
    "token": "staleflow_cli.tokens:app",
    "dataset": "staleflow_cli.dataset:app",
    "launch": "staleflow_cli.launch_ray:app",
    "experiment": "staleflow_cli.experiment:app",
    "sim": "staleflow_cli.sim:app",
}


@functools.cache
def _load(name: str) -> Any:
    """The click command of `name`, importing its module; a stand-in that names the extra to
    install when the module needs one that is missing."""
    module, _, attr = COMMANDS[name].partition(":")
    try:
        target = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        missing = missing_extra(exc)
        if missing is None:
            raise
        return _not_installed(name, str(missing))
    # Registered on a group as the root would have (no completion options of their own).
    holder = typer.Typer(add_completion=False)
    holder.callback()(lambda: None)
    if isinstance(target, typer.Typer):
        holder.add_typer(target, name=name)
    else:
        holder.command(name)(target)
    return typer.main.get_command(holder).commands[name]  # type: ignore[attr-defined]


def _not_installed(name: str, why: str) -> Any:
    stand_in = typer.Typer()

    @stand_in.command(
        name,
        help=f"(not installed here: {escape(why)})",  # `[server]` is not rich markup
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    )
    def refuse() -> None:
        print(f"error: staleflow {name}: {why}", file=sys.stderr)
        raise typer.Exit(1)

    return typer.main.get_command(stand_in)


class LazyGroup(TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *COMMANDS]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in COMMANDS:
            return _load(cmd_name)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    name="staleflow",
    help="StaleFlow: PostgreSQL-backed data layer for asynchronous RL post-training.",
    no_args_is_help=True,
    add_completion=False,
    cls=LazyGroup,
)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    # Progress messages (server start, migrations) go to stderr, so stdout stays
    # parseable: `psql "$(staleflow db url)"`.
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    for noisy in ("sqlalchemy", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Alembic says these two lines on every connection; its "Running upgrade" lines stay.
    logging.getLogger("alembic.runtime.migration").addFilter(
        lambda r: not r.getMessage().startswith(("Context impl", "Will assume"))
    )


if __name__ == "__main__":
    app()
