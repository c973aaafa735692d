"""Shared checks of deploy/: the `staleflow` command lines the manifests and the compose file
run, checked against the real typer app (subcommands and their options)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from staleflow_cli.main import app

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def check_staleflow_args(args: list[str]) -> list[str]:
    """Problems with `staleflow ARGS...`: an unknown (sub)command or an option it lacks."""
    # typer's own (vendored) click: groups are the commands with subcommands.
    cmd: Any = typer.main.get_command(app)
    path = ["staleflow"]
    rest = list(args)
    while hasattr(cmd, "list_commands"):
        if not rest or rest[0].startswith("-"):
            return [f"{' '.join(path)}: no subcommand given in {args}"]
        sub = cmd.get_command(None, rest[0])
        if sub is None:
            return [f"{' '.join(path)} has no subcommand {rest[0]!r} ({args})"]
        path.append(rest.pop(0))
        cmd = sub
    known = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    return [
        f"{' '.join(path)} has no option {a.split('=')[0]!r}"
        for a in rest
        if a.startswith("--") and a.split("=")[0] not in known
    ]
