"""``staleflow lineage RUN --step S``: what a trained step was made of, token to checkpoint."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from staleflow_db.audit import find_run
from staleflow_db.db import make_engine
from staleflow_db.errors import NotFound
from staleflow_db.protocol import Protocol


def lineage(
    run: str = typer.Argument(..., help="Run id or name."),
    step: int = typer.Option(..., "--step", min=0, help="The trained step."),
    sample: int | None = typer.Option(None, "--sample", min=1, help="Only this sample."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Per segment of each sample trained at the step: turn (generated or observation), model
    version and instance, that version's published checksum and the step that published it,
    the reward, its metrics and the API token that posted it (view `trained_lineage`)."""
    engine = make_engine()
    try:
        run_id = find_run(engine, run)
        rows = Protocol(engine).reads.lineage(run_id, step, sample)
    except NotFound as e:
        raise typer.BadParameter(str(e), param_hint="RUN / --step / --sample") from None
    finally:
        engine.dispose()
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    table = Table(title=f"run {run}: lineage of step {step} ({len({r['sample_id'] for r in rows})} samples)")
    for col in ("sample", "seq", "turn", "tokens", "version", "instance", "checksum", "from step", "reward", "scorer"):
        table.add_column(col, justify="left" if col in ("turn", "checksum", "instance", "scorer") else "right")
    for r in rows:
        metrics = ", ".join(f"{k}={v:g}" for k, v in (r["reward_metrics"] or {}).items())
        table.add_row(
            str(r["sample_id"]),
            str(r["seq"]),
            "generated" if r["generated"] else "observation",
            str(r["n_tokens"]),
            "-" if r["version"] is None else str(r["version"]),
            f"{r['instance_name'] or '?'} ({r['instance_id']})",
            (r["checksum"] or ("initial model" if r["version"] == 0 else "-"))[:20],
            "-" if r["published_by_step"] is None else str(r["published_by_step"]),
            f"{r['reward']:.3f}" + (f" ({metrics})" if metrics else ""),
            "in-process"
            if r["scorer_token_id"] is None
            else f"token {r['scorer_token_id']} {r['scorer_name'] or ''} ({r['scorer_role']})",
        )
    Console().print(table)
