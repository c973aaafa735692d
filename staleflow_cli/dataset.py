"""``staleflow dataset``: data sets the project generates itself (no download)."""

from __future__ import annotations

from pathlib import Path

import typer

from staleflow_cli.common import console, fail
from workers.extras import MissingExtra

app = typer.Typer(help="Generate data sets (JSON Lines or Parquet) for `staleflow enqueue`.", no_args_is_help=True)


@app.command()
def arithmetic(
    n: int = typer.Option(1000, "--n", min=1, help="number of problems"),
    seed: int = typer.Option(0, "--seed", help="the same seed gives the same file"),
    levels: str = typer.Option(
        "1,2,3", "--levels", help="difficulty levels to draw from (1: a+b ... 3: four operations)"
    ),
    out: Path = typer.Option(
        ..., "--out", dir_okay=False, help="the file to write: JSON Lines, or Parquet if it ends in .parquet"
    ),
) -> None:
    """Arithmetic problems with exact integer answers: fields id, prompt, answer, level.

    Enqueue them with `staleflow enqueue RUN --data OUT --prompt-field prompt
    --answer-field answer --key-field id` and score them with `--verifier math`."""
    from workers.tasks.arithmetic import LEVELS, problems, write_jsonl

    try:
        chosen = tuple(int(x) for x in levels.split(",") if x.strip())
    except ValueError:
        chosen = ()
    if not chosen or set(chosen) - set(LEVELS):
        raise typer.BadParameter(f"{levels!r}: levels are comma-separated among {LEVELS}", param_hint="--levels")
    if out.suffix.lower() == ".parquet":
        from workers.tasks.data import write_parquet

        try:
            write_parquet(out, problems(n, seed, chosen))
        except MissingExtra as e:
            raise fail(str(e)) from None
    else:
        write_jsonl(out, n, seed, chosen)
    console.print(f"wrote {n} arithmetic problems to {out}")
