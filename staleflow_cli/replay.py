"""``staleflow replay EXPORT --step S [--checkpoint PATH]``: a trained step's batch rebuilt from an
export, and its loss recomputed from the step's checkpoint (workers/trainer/replay.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from staleflow_cli.common import fail, need


def replay(
    export: Path = typer.Argument(..., help="An export folder (staleflow export RUN --out DIR --trained)."),
    step: int = typer.Option(..., "--step", min=0, help="The trained step (it trains model version S into S + 1)."),
    checkpoint: Path | None = typer.Option(
        None,
        "--checkpoint",
        help="The checkpoint the step started from: the trainer's versions/vS.pt (staleflow trainer --save-every). "
        "Without it, the batch is rebuilt and described.",
    ),
    steps_log: Path | None = typer.Option(
        None, "--steps-log", help="The trainer's steps.jsonl (default: the one beside the checkpoint)."
    ),
    tolerance: float = typer.Option(1e-5, "--tolerance", min=0.0, help="Relative difference accepted."),
    device: str = typer.Option("cpu", "--device"),
    as_json: bool = typer.Option(False, "--json", help="Print the batch (no --checkpoint) or the result as JSON."),
) -> None:
    """Rebuild the batch step S trained on, as the trainer consumed it; with --checkpoint, train
    it again from the step's weights and optimizer state with the trainer's own code and print
    the loss next to the one the trainer logged, with the difference (exit 1 beyond
    --tolerance), and whether the weights it ends with are the version the trainer trained."""
    from workers.export_read import Export, ExportError

    try:
        ex = Export(export)
        batch = ex.batch(step) if checkpoint is None else None
    except ExportError as e:
        raise typer.BadParameter(str(e), param_hint="EXPORT / --step") from None
    if batch is not None:
        if as_json:
            print(batch.model_dump_json(indent=2))
            return
        from workers.trainer.replay import batch_summary

        print(batch_summary(batch))
        return
    assert checkpoint is not None
    need("torch")
    from workers.trainer.loop import TrainerError
    from workers.trainer.replay import ReplayError
    from workers.trainer.replay import replay as run_replay

    try:
        out = run_replay(ex, step, checkpoint, steps_log, device)
    except ExportError as e:
        raise typer.BadParameter(str(e), param_hint="EXPORT / --step") from None
    except ReplayError as e:
        raise typer.BadParameter(str(e), param_hint="--checkpoint / --steps-log") from None
    except TrainerError as e:
        raise fail(str(e)) from None
    if as_json:
        print(json.dumps({**out.__dict__, "diff": out.diff}, indent=2))
    else:
        print(out.line())
    if out.logged_loss is not None and not out.matches(rel=tolerance):
        raise fail(f"step {step}: the recomputed loss differs from the logged one by {out.diff:+.3e}")
