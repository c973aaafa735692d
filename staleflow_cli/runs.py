"""``staleflow run create / list / show / pause / resume / cancel``: runs over the REST API.

Like every command that reaches the API (staleflow_cli/common.py): ``--api`` (or
STALEFLOW_API_URL, else where ``staleflow serve`` listens) and ``--token`` (or STALEFLOW_TOKEN,
else the admin token ``staleflow serve`` writes to ``$STALEFLOW_HOME/token`` for the local
user). So on a machine running ``staleflow serve``, ``staleflow run create NAME -B 8 -N 4
--eta 2`` works as is; elsewhere pass an admin token (``staleflow token create --role
admin``). A run is named by its id or its name everywhere.
"""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.markup import escape

from staleflow_cli.common import API, TOKEN, console, fail
from workers.client import ApiError, Forbidden, StaleFlowClient, Unauthorized, Unavailable
from workers.wire.models import RunOut, RunStatus
from workers.wire.run_config import SPECS, default

app = typer.Typer(help="Runs: create, list, show, pause, resume, cancel.", no_args_is_help=True)

RUN_ARG = typer.Argument(..., help="run id or name")
REASON = typer.Option(None, "--reason", help="why (kept with the run, shown by `run show`)")
JSON = typer.Option(False, "--json", help="print the API's JSON instead of text")


def _help(field: str) -> str:
    return SPECS[field].description


def _client(api: list[str] | None, token: str | None) -> StaleFlowClient:
    client = StaleFlowClient(api or None, token or None, retry_for=5.0)
    if not client.token:
        raise fail(
            "no token: run `staleflow serve` on this machine (it writes an admin token for you), "
            "or pass --token / set STALEFLOW_TOKEN to an admin token (`staleflow token create --role admin`)"
        )
    return client


def _call(client: StaleFlowClient, what: str, call: Any) -> Any:
    """`call()` with the API's refusals as one clear line each."""
    try:
        return call()
    except Unauthorized:
        raise fail(f"the API at {client.url} refused the token (pass --token or set STALEFLOW_TOKEN)") from None
    except Forbidden as e:
        raise fail(f"{what}: {e.message} (run management needs an admin token)") from None
    except Unavailable:
        raise fail(
            f"cannot reach the StaleFlow API at {', '.join(client.urls)} (is `staleflow serve` running?)"
        ) from None
    except ApiError as e:
        raise fail(f"{what}: {e.message}") from None
    finally:
        client.close()


def _config_line(config: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in config.model_dump().items())


def _run_line(r: RunOut) -> str:
    why = f" ({r.state_reason})" if r.state_reason and r.state.value != "active" else ""
    return f"{r.id}\t{r.name}\t{r.state.value}{why}\tversion {r.version}\t{_config_line(r.config)}"


def _print(out: Any, as_json: bool, text: str) -> None:
    print(out.model_dump_json(indent=2) if as_json else text)


@app.command()
def create(
    name: str = typer.Argument(..., help="the run's name (unique; not all digits, no '/')"),
    batch_size: int = typer.Option(..., "--batch-size", "-B", help=_help("batch_size")),
    group_size: int = typer.Option(..., "--group-size", "-N", help=_help("group_size")),
    eta: int = typer.Option(..., "--eta", help=_help("eta")),
    buffer_capacity: int | None = typer.Option(None, "--buffer-capacity", help=_help("buffer_capacity")),
    samples_per_group: int | None = typer.Option(None, "--samples-per-group", help=_help("samples_per_group")),
    max_response_tokens: int = typer.Option(
        default("max_response_tokens"), "--max-response-tokens", help=_help("max_response_tokens")
    ),
    max_prompt_tokens: int = typer.Option(
        default("max_prompt_tokens"), "--max-prompt-tokens", help=_help("max_prompt_tokens")
    ),
    dapo_filter: bool = typer.Option(
        default("dapo_filter"), "--dapo-filter/--no-dapo-filter", help=_help("dapo_filter")
    ),
    temperature: float = typer.Option(default("temperature"), "--temperature", help=_help("temperature")),
    top_p: float = typer.Option(default("top_p"), "--top-p", help=_help("top_p")),
    as_json: bool = JSON,
    api: list[str] | None = API,
    token: str | None = TOKEN,
) -> None:
    """Create a run (admin). Prints its id, name and configuration."""
    config: dict[str, Any] = {
        "batch_size": batch_size,
        "group_size": group_size,
        "eta": eta,
        "buffer_capacity": buffer_capacity,
        "samples_per_group": samples_per_group,
        "max_response_tokens": max_response_tokens,
        "max_prompt_tokens": max_prompt_tokens,
        "dapo_filter": dapo_filter,
        "temperature": temperature,
        "top_p": top_p,
    }
    client = _client(api, token)
    try:
        out = _call(client, f"create run {name!r}", lambda: client.create_run(name, **config))
    except ValueError as e:  # the request model's bounds, checked before anything is sent
        raise fail(f"create run {name!r}: {e}") from None
    console.print(escape(f"created run {out.id} ({out.name})"))
    _print(out, as_json, _run_line(out))


@app.command("list")
def list_(
    limit: int = typer.Option(100, "--limit", min=1, max=10_000),
    as_json: bool = JSON,
    api: list[str] | None = API,
    token: str | None = TOKEN,
) -> None:
    """Runs by id: id, name, state, version, configuration (a run-scoped token sees its own)."""
    client = _client(api, token)
    runs = _call(client, "list runs", lambda: client.list_runs(limit=limit))
    if as_json:
        print(json.dumps([r.model_dump(mode="json") for r in runs], indent=2))
        return
    for r in runs:
        print(_run_line(r))


@app.command()
def show(
    run: str = RUN_ARG,
    as_json: bool = JSON,
    api: list[str] | None = API,
    token: str | None = TOKEN,
) -> None:
    """A run's state, version, configuration, buffers and counts."""
    client = _client(api, token)
    s: RunStatus = _call(client, f"run {run!r}", lambda: client.run_status(run))
    if as_json:
        print(s.model_dump_json(indent=2))
        return
    why = f" ({s.state_reason})" if s.state_reason and s.state.value != "active" else ""
    lines = [
        f"run {s.run_id} ({s.name}): {s.state.value}{why}, version {s.version}",
        f"config: {_config_line(s.config)}",
        "buffers: " + (" ".join(f"{b.index}:{b.state}({b.occupied}+{b.reserved})" for b in s.buffers) or "none"),
        "samples: " + (" ".join(f"{k}={v}" for k, v in sorted(s.samples.items())) or "none"),
        "groups: " + (" ".join(f"{k}={v}" for k, v in sorted(s.groups.items())) or "none"),
        f"active instances: {s.active_instances}",
    ]
    print("\n".join(lines))


def _lifecycle(action: str, done: str, run: str, reason: str | None, as_json: bool, api: Any, token: Any) -> None:
    client = _client(api, token)
    out = _call(client, f"{action} run {run!r}", lambda: client.set_run_state(run, action, reason))
    aborted = f"; {out.aborted_groups} unfinished group(s) aborted (run_cancelled)" if action == "cancel" else ""
    console.print(escape(f"run {out.run.id} ({out.run.name}) {done}{aborted}"))
    _print(out, as_json, _run_line(out.run))


def _lifecycle_command(action: str, done: str, help_text: str) -> None:
    """`staleflow run ACTION RUN [--reason R]`: one command per lifecycle change."""

    def command(
        run: str = RUN_ARG,
        reason: str | None = REASON,
        as_json: bool = JSON,
        api: list[str] | None = API,
        token: str | None = TOKEN,
    ) -> None:
        _lifecycle(action, done, run, reason, as_json, api, token)

    app.command(name=action, help=help_text)(command)


for _verb, _past, _text in (
    ("pause", "paused", "Pause: nothing new is routed; in-flight samples finish, are scored and train."),
    ("resume", "resumed", "Resume a paused run."),
    (
        "cancel",
        "cancelled",
        "Cancel for good: unfinished work is aborted (run_cancelled); then enqueue, routing, training refused.",
    ),
):
    _lifecycle_command(_verb, _past, _text)
