"""``staleflow export RUN --out DIR``: a run's rollouts as Parquet or JSON lines, resumable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from workers.export import FORMATS, PageSource
from workers.export import export as write_export

from .common import API, TOKEN, connect

API_VERSIONS = 10_000  # the most GET /v1/runs/{run}/versions lists


def export(
    run: str = typer.Argument(..., help="Run id or name."),
    out: Path = typer.Option(..., "--out", help="The folder to write (an export there is continued)."),
    trained: bool = typer.Option(False, "--trained/--all", help="Only trained samples, or every sample."),
    fmt: str = typer.Option("parquet", "--format", help=f"One of {', '.join(FORMATS)}."),
    page: int = typer.Option(500, "--page", min=1, max=1000, help="Samples read per request (one row group)."),
    chunk: int = typer.Option(10_000, "--chunk", min=1, help="Samples per file."),
    via_api: bool = typer.Option(
        False, "--via-api", help="Read through the REST API (--api, --token) instead of the database."
    ),
    api: list[str] | None = API,
    token: str | None = TOKEN,
) -> None:
    """Write the run's samples (ids, group, prompt and response tokens, per-token log-probs,
    versions and loss mask, segment boundaries, reward and metrics, staleness, timings, state
    and drop reason) in sample id order, one file per chunk, with run.json (the run's
    configuration) and manifest.json (what is written: running the command again continues
    after it), and steps.jsonl (each published version's step, checksum and the loss and
    metrics its trainer reported: what `staleflow replay` compares with). Loads with
    `datasets.load_dataset("parquet", data_files=...)` and pandas."""
    if fmt not in FORMATS:
        raise typer.BadParameter(f"one of {', '.join(FORMATS)}", param_hint="--format")
    with _source(run, trained, via_api, api, token) as (source, info, total, versions):
        with Progress(
            TextColumn("export"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=Console(stderr=True)
        ) as bar:
            task = bar.add_task("samples", total=total)
            try:
                manifest = write_export(
                    source,
                    out,
                    info,
                    fmt=fmt,
                    trained=trained,
                    page=page,
                    chunk=chunk,
                    progress=lambda n: bar.advance(task, n),
                    versions=versions,
                )
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint="--out") from None
    Console().print(f"{manifest.rows} samples in {len(manifest.files or [])} files under {out}")


@contextmanager
def _source(
    run: str, trained: bool, via_api: bool, api: list[str] | None, token: str | None
) -> Iterator[tuple[PageSource, dict[str, Any], int | None, list[dict[str, Any]]]]:
    """The pages (keyset reads), the run's description for run.json, the number of samples
    (None through the API: the bar then counts without a total) and the published versions,
    oldest first."""
    if via_api:
        client, run_id = connect(api, token, run, wait_s=0)
        try:
            versions = [v.model_dump(mode="json") for v in client.param_versions(run_id, API_VERSIONS)]
            if len(versions) == API_VERSIONS:
                Console(stderr=True).print(
                    f"the API lists the newest {API_VERSIONS} versions: steps.jsonl holds those steps only"
                )
            yield (
                lambda after, n: [r.model_dump() for r in client.export_page(run_id, after, n, trained).rows],
                client.run_status(run_id).model_dump(mode="json"),
                None,
                versions[::-1],
            )
        finally:
            client.close()
        return
    # here, not at the top: a worker node's install (no database stack) exports --via-api
    from staleflow_db.audit import find_run
    from staleflow_db.db import make_engine
    from staleflow_db.errors import NotFound
    from staleflow_db.protocol import Protocol

    engine = make_engine()
    try:
        try:
            run_id = find_run(engine, run)
        except NotFound as e:
            raise typer.BadParameter(str(e), param_hint="RUN") from None
        reads = Protocol(engine).reads
        yield (
            lambda after, n: reads.export_page(run_id, after, n, trained),
            asdict(reads.get_run(run_id)),
            reads.export_count(run_id, trained),
            [asdict(v) for v in reversed(reads.param_versions(run_id, 2**31 - 1))],
        )
    finally:
        engine.dispose()
