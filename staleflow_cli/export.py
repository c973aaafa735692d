"""``staleflow export RUN --out DIR``: a run's rollouts as Parquet or JSON lines, resumable."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from staleflow_db.audit import find_run
from staleflow_db.db import make_engine
from staleflow_db.errors import NotFound
from staleflow_db.protocol import Protocol
from workers.export import FORMATS
from workers.export import export as write_export


def export(
    run: str = typer.Argument(..., help="Run id or name."),
    out: Path = typer.Option(..., "--out", help="The folder to write (an export there is continued)."),
    trained: bool = typer.Option(False, "--trained/--all", help="Only trained samples, or every sample."),
    fmt: str = typer.Option("parquet", "--format", help=f"One of {', '.join(FORMATS)}."),
    page: int = typer.Option(500, "--page", min=1, max=1000, help="Samples read per query (one row group)."),
    chunk: int = typer.Option(10_000, "--chunk", min=1, help="Samples per file."),
) -> None:
    """Write the run's samples (ids, group, prompt and response tokens, per-token log-probs,
    versions and loss mask, segment boundaries, reward and metrics, staleness, timings, state
    and drop reason) in sample id order, one file per chunk, with run.json (the run's
    configuration) and manifest.json (what is written: running the command again continues
    after it). Loads with `datasets.load_dataset("parquet", data_files=...)` and pandas."""
    if fmt not in FORMATS:
        raise typer.BadParameter(f"one of {', '.join(FORMATS)}", param_hint="--format")
    engine = make_engine()
    try:
        try:
            run_id = find_run(engine, run)
        except NotFound as e:
            raise typer.BadParameter(str(e), param_hint="RUN") from None
        reads = Protocol(engine).reads
        info = asdict(reads.get_run(run_id))
        total = reads.export_count(run_id, trained)
        with Progress(
            TextColumn("export"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=Console(stderr=True)
        ) as bar:
            task = bar.add_task("samples", total=total)
            try:
                manifest = write_export(
                    lambda after, n: reads.export_page(run_id, after, n, trained),
                    out,
                    info,
                    fmt=fmt,
                    trained=trained,
                    page=page,
                    chunk=chunk,
                    progress=lambda n: bar.advance(task, n),
                )
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint="--out") from None
    finally:
        engine.dispose()
    Console().print(f"{manifest.rows} samples in {len(manifest.files or [])} files under {out}")
