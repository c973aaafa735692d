"""``staleflow audit RUN``: staleness per step, drops by reason, invariant violations."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from staleflow_db.audit import find_run, summary
from staleflow_db.db import make_engine
from staleflow_db.errors import NotFound


def audit(
    run: str = typer.Argument(..., help="Run id or name."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    strict: bool = typer.Option(
        False, "--strict", help="Exit 1 if any invariant is violated (and print every violation)."
    ),
) -> None:
    """Audit a run from the database alone. Reports only; with --strict, exits 1 on any
    row of `staleness_violations` for the run."""
    engine = make_engine()
    try:
        data = summary(engine, find_run(engine, run))
    except NotFound as e:
        raise typer.BadParameter(str(e), param_hint="RUN") from None
    finally:
        engine.dispose()
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        render(data, Console(), limit=None if strict else 50)
    if strict and data["violations"]:
        raise typer.Exit(1)


def render(data: dict, console: Console, limit: int | None = 50) -> None:
    eta = data["eta"]
    steps = Table(title=f"run {data['name']} (id {data['run_id']}): version {data['version']}, eta {eta}")
    steps.add_column("step", justify="right")
    steps.add_column("samples", justify="right")
    steps.add_column("tokens", justify="right")
    steps.add_column("mean reward", justify="right")
    for s in range(eta + 1):
        steps.add_column(f"stale {s}", justify="right")
    for row in data["steps"]:
        steps.add_row(
            str(row["step"]),
            str(row["samples"]),
            str(row["tokens"]),
            f"{row['mean_reward']:.3f}",
            *(str(row["staleness"].get(s, 0)) for s in range(eta + 1)),
        )
    console.print(steps)
    drops = Table(title="dropped samples")
    drops.add_column("reason")
    drops.add_column("samples", justify="right")
    drops.add_column("tokens", justify="right")
    for d in data["drops"]:
        drops.add_row(d["reason"], str(d["samples"]), str(d["tokens"]))
    console.print(drops)
    if data["violations"]:
        console.print(f"[red]{len(data['violations'])} invariant violations[/red]")
        for v in data["violations"][:limit]:
            console.print(
                f"  {v['invariant']}: {v['subject']}: {v['detail']}", markup=False, highlight=False, soft_wrap=True
            )
    else:
        console.print("[green]staleness_violations: none[/green]")
