"""The ``staleflow`` command.

Each command group lives in its own module exporting a ``typer.Typer`` and is
registered below with one ``add_typer`` line; keep this root small.
"""

from __future__ import annotations

import logging
import sys

import typer

from staleflow_cli.audit import audit
from staleflow_cli.coordinator import coordinator
from staleflow_cli.dataset import app as dataset_app
from staleflow_cli.db import app as db_app
from staleflow_cli.demo import demo
from staleflow_cli.enqueue import enqueue
from staleflow_cli.experiment import app as experiment_app
from staleflow_cli.launch_ray import app as launch_app
from staleflow_cli.reward import reward_worker
from staleflow_cli.rollout import rollout_worker
from staleflow_cli.serve import serve
from staleflow_cli.sim import app as sim_app
from staleflow_cli.tokens import app as token_app
from staleflow_cli.trainer import ps, trainer

app = typer.Typer(
    name="staleflow",
    help="StaleFlow: PostgreSQL-backed data layer for asynchronous RL post-training.",
    no_args_is_help=True,
    add_completion=False,
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


app.add_typer(db_app, name="db")
app.command()(serve)
app.add_typer(token_app, name="token")
app.command()(audit)
app.command()(coordinator)
app.command()(demo)
app.command()(enqueue)
app.add_typer(dataset_app, name="dataset")
app.add_typer(launch_app, name="launch")
app.add_typer(experiment_app, name="experiment")
app.add_typer(sim_app, name="sim")
app.command("trainer")(trainer)
app.command("ps")(ps)
app.command("rollout-worker")(rollout_worker)
app.command("reward-worker")(reward_worker)


if __name__ == "__main__":
    app()
