"""``staleflow offload RUN``: move a run's finished segments' payloads to the payload store."""

from __future__ import annotations

import time

import typer

from staleflow_db.audit import find_run
from staleflow_db.db import make_engine
from staleflow_db.errors import NotFound
from staleflow_db.payload_store import PayloadStoreError, offload_run, open_store


def offload(
    run: str = typer.Argument(..., help="Run id or name."),
    store: str | None = typer.Option(
        None,
        "--store",
        help="file:///folder or s3://bucket/prefix (default: STALEFLOW_PAYLOAD_STORE, else file://<home>/payloads).",
    ),
    every: float = typer.Option(
        0.0, "--every", min=0.0, help="Keep going: offload again every this many seconds (0: once, then exit)."
    ),
) -> None:
    """Write the payloads (token ids, log-probs) of the run's finished segments (sample aborted,
    or trained) to the payload store, one object per batch, and keep only the metadata,
    lineage and an object reference in the database. The audit and `staleflow export` read
    them through the store. Idempotent and safe to interrupt: run it again at any time."""
    engine = make_engine()
    try:
        run_id = find_run(engine, run)
        target = open_store(store)
        while True:
            done = offload_run(engine, target, run_id)
            typer.echo(
                f"offload run {run_id}: {done.segments} segments, {done.bytes} bytes in {done.objects} objects"
                f" to {target.url}"
            )
            if every <= 0:
                break
            time.sleep(every)
    except NotFound as e:
        raise typer.BadParameter(str(e), param_hint="RUN") from None
    except PayloadStoreError as e:
        raise typer.BadParameter(str(e), param_hint="--store") from None
    finally:
        engine.dispose()
