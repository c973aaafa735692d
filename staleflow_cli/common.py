"""What the worker commands share: ``trainer`` and ``ps`` (staleflow_cli/trainer.py),
``rollout-worker`` (rollout.py) and ``reward-worker`` (reward.py).

Every command reaches the API with ``--api`` (or STALEFLOW_API_URL, else the client's
default, the address ``staleflow serve`` listens on) and ``--token`` (or STALEFLOW_TOKEN,
else the local token file ``staleflow serve`` writes). Several replicas: repeat ``--api`` or
separate URLs by commas; the client fails over between them. The commands are long-running:
an API (or database) outage is waited out, at start-up too (``--api-wait`` bounds that). Torch is imported only by the
commands that need it, so ``--help``, the reward worker and the sim trainer start fast.

The torch trainer and torch rollout workers must build the same model: both take
``--model-config`` (TinyConfig fields as JSON, or a path to a JSON file; defaults shared)
(or both ``--model FOLDER``, a Hugging Face model folder) and get their weights from the
PS, where the trainer pushes version 0 when it starts.

SIGTERM/SIGINT: finish the current step (trainer) or flush reports and deregister
(rollout), then exit 0; a second signal exits at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from workers.client import Forbidden, NotFound, StaleFlowClient, Unauthorized, Unavailable
from workers.extras import MissingExtra, require
from workers.wire.types import is_run_id

if TYPE_CHECKING:
    from workers.models.tiny_model import TinyConfig
    from workers.trainer.param_client import ParamClient

console = Console(stderr=True)

RUN = typer.Option(..., "--run", help="run id or name")
API = typer.Option(
    None,
    "--api",
    "--api-url",
    envvar="STALEFLOW_API_URL",
    show_envvar=True,
    help="API base URL (default: the client's, where `staleflow serve` listens); several "
    "replicas: repeat the option or separate URLs by commas, the worker fails over",
)
API_WAIT = typer.Option(
    None, "--api-wait", min=0.0, help="seconds to wait for an unreachable API at start-up (default: for ever)"
)
TOKEN = typer.Option(
    None,
    "--token",
    envvar="STALEFLOW_TOKEN",
    show_envvar=True,
    help="bearer token (default: the local token file `staleflow serve` writes)",
)
MODEL_CONFIG = typer.Option(
    None,
    "--model-config",
    help="tiny-model config as JSON or a path to a JSON file (TinyConfig fields); "
    "must match between trainer and rollout workers",
)
# The text <-> tokens of a multi-turn environment (`--env`), for the rollout and reward workers.
ENV_CODEC = typer.Option(None, "--codec", help="--env's text <-> tokens, module:ClassOrFactory (default: UTF-8 bytes)")
MODEL_SEED = typer.Option(0, "--model-seed", help="seed of the initial weights (the same everywhere)")
HF_MODEL = typer.Option(
    None,
    "--model",
    help="a Hugging Face causal-LM folder (config, weights, tokenizer) instead of the tiny model; "
    "the same folder for the trainer and the rollout workers",
)


# ---- shared helpers ---------------------------------------------------------------------------


def connect(
    api: list[str] | None, token: str | None, run: str, wait_s: float | None = None
) -> tuple[StaleFlowClient, int]:
    """A client and the run id. The client retries outages for ever (a worker rides through
    them); at start-up an unreachable API is waited for (`wait_s` seconds, None: for ever),
    while refusals (token, run) fail at once with a clear message."""
    client = StaleFlowClient(api or None, token or None, retry_for=None)  # empty env vars mean "not set"
    urls = ", ".join(client.urls)
    try:
        client.request("GET", "/healthz", retry_for=0)
    except Unavailable:
        console.print(
            escape(
                f"waiting for the StaleFlow API at {urls} "
                f"({'for ever' if wait_s is None else f'up to {wait_s:g}s'}) ..."
            )
        )
        try:
            client.request("GET", "/healthz", retry_for=wait_s)
        except Unavailable:
            raise typer.BadParameter(
                f"cannot reach the StaleFlow API at {urls} (is `staleflow serve` running?)", param_hint="--api"
            ) from None
        console.print(escape(f"the StaleFlow API at {client.url} answers"))
    url = client.url
    if not client.token:
        raise typer.BadParameter(
            "no token: pass --token, set STALEFLOW_TOKEN, or run `staleflow serve` locally (it writes one)",
            param_hint="--token",
        )
    try:
        run_id = client.run_status(run).run_id  # an id or a name: the API resolves either
    except Unauthorized:
        raise typer.BadParameter(f"the API at {url} refused the token", param_hint="--token") from None
    except NotFound:
        named = "" if is_run_id(run) else "named "
        raise typer.BadParameter(f"no run {named}{run!r}", param_hint="--run") from None
    except Forbidden as e:
        raise typer.BadParameter(f"this token may not use run {run!r}: {e.message}", param_hint="--run") from None
    return client, run_id


def run_sampling(client: StaleFlowClient, run_id: int, temperature: float | None) -> tuple[float, float]:
    """The run's sampling parameters (temperature, top_p), recorded when it was created: they
    are authoritative for every engine and trainer of the run (the engines' log-probs and the
    trainer's must be of the same distribution), so a `--temperature` given that differs is
    refused rather than silently used or silently ignored."""
    return sampling_of(client.run_status(run_id).config.model_dump(), run_id, temperature)


def sampling_of(config: dict[str, Any], run_id: int, temperature: float | None) -> tuple[float, float]:
    """`run_sampling` of a run configuration at hand (an export's run.json)."""
    run_t, top_p = float(config["temperature"]), float(config["top_p"])
    if temperature is not None and not math.isclose(temperature, run_t):
        raise typer.BadParameter(
            f"run {run_id} samples at temperature {run_t:g} (set by `staleflow run create "
            f"--temperature`); {temperature:g} conflicts: leave --temperature out",
            param_hint="--temperature",
        )
    return run_t, top_p


def model_config(spec: str | None) -> TinyConfig:
    need("torch")
    from workers.models.tiny_model import TinyConfig

    if not spec:
        return TinyConfig()
    try:
        text = Path(spec).read_text() if not spec.lstrip().startswith("{") else spec
        return TinyConfig(**json.loads(text))
    except (OSError, ValueError, TypeError) as e:  # bad path, bad JSON, unknown or bad field
        raise typer.BadParameter(f"{e}", param_hint="--model-config") from None


def hf_folder(path: Path) -> None:
    """Refuse a --model that is not a model folder before anything starts."""
    need("transformers")
    if not (path / "config.json").is_file():
        raise typer.BadParameter(f"{path} is not a Hugging Face model folder (no config.json)", param_hint="--model")


def ps_client(addr: str | None) -> ParamClient | None:
    """A client of the PS at `addr`, checked before anything starts; `ps_login` gives it its key."""
    if addr is None:
        return None
    need("torch")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise typer.BadParameter(f"{addr!r} is not HOST:PORT", param_hint="--ps")
    from workers.trainer.param_client import ParamClient

    # Long-running workers ride through a PS restart (it reloads its versions from disk).
    return ParamClient((host, int(port)), retry_for=None)


def ps_login(pc: ParamClient | None, client: StaleFlowClient, run_id: int, role: str) -> None:
    """Give `pc` this token's `role` key for the run's PS (the PS refuses a client without)."""
    if pc is None:
        return
    from workers.trainer.param_auth import PSAuthError, PSCredentials

    try:
        pc.credentials = PSCredentials.fetch(client, run_id, role)
    except (Forbidden, PSAuthError) as e:
        raise fail(f"no {role} key for run {run_id}'s parameter server: {e}") from None


def on_signals(stop: Callable[[], None], what: str) -> None:
    fired: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if fired:
            raise SystemExit(128 + signum)
        fired.append(signum)
        console.print(f"[yellow]{signal.Signals(signum).name}: {what}, then exiting (again to force)")
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


@contextlib.contextmanager
def progress(total: int | None, description: str) -> Iterator[tuple[Progress, Any]]:
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as p:
        yield p, p.add_task(description, total=total)


def fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(message)}")  # messages may hold [brackets]
    return typer.Exit(1)


def need(*modules: str) -> None:
    """Fail at once, naming the extra to install, rather than midway through a command."""
    for module in modules:
        try:
            require(module)
        except MissingExtra as e:
            raise fail(str(e)) from None


def torch_device(value: str, param_hint: str = "--device") -> str:
    """`value` if it names a torch device this host has: a name torch does not know, or a CUDA
    device where there is none, is a usage error before anything starts, not a crash after the
    process has connected and loaded its model."""
    need("torch")
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise typer.BadParameter(
            f"{value!r} is not a torch device (cpu, cuda, cuda:N, ...)", param_hint=param_hint
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise typer.BadParameter(f"{value}: this host has no CUDA GPU", param_hint=param_hint)
        if device.index is not None and device.index >= count:
            raise typer.BadParameter(f"{value}: this host has {count} CUDA GPU(s)", param_hint=param_hint)
    return value
