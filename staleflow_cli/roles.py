"""Worker processes as ``staleflow`` commands: ``trainer``, ``ps``, ``rollout-worker`` and
``reward-worker``.

Every command reaches the API with ``--api`` (or STALEFLOW_API_URL, else the client's
default, the address ``staleflow serve`` listens on) and ``--token`` (or STALEFLOW_TOKEN,
else the local token file ``staleflow serve`` writes). Several replicas: repeat ``--api`` or
separate URLs by commas; the client fails over between them. The commands are long-running:
an API (or database) outage is waited out, at start-up too (``--api-wait`` bounds that). Torch is imported only by the
commands that need it, so ``--help``, the reward worker and the sim trainer start fast.

The torch trainer and torch rollout workers must build the same model: both take
``--model-config`` (TinyConfig fields as JSON, or a path to a JSON file; defaults shared)
and get their weights from the PS, where the trainer pushes version 0 when it starts.

SIGTERM/SIGINT: finish the current step (trainer) or flush reports and deregister
(rollout), then exit 0; a second signal exits at once.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_fixed

from staleflow_db.settings import get_settings
from workers.client import ApiError, Forbidden, NotFound, StaleFlowClient, Unauthorized, Unavailable

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
MODEL_SEED = typer.Option(0, "--model-seed", help="seed of the initial weights (the same everywhere)")


class Engine(str, enum.Enum):
    torch = "torch"
    sim = "sim"
    vllm = "vllm"


class Backend(str, enum.Enum):
    gloo = "gloo"
    nccl = "nccl"


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
        run_id = int(run) if run.isdigit() else _run_by_name(client, run)
        client.run_status(run_id)
    except Unauthorized:
        raise typer.BadParameter(f"the API at {url} refused the token", param_hint="--token") from None
    except NotFound:
        raise typer.BadParameter(f"no run {run!r}", param_hint="--run") from None
    except Forbidden as e:
        raise typer.BadParameter(f"this token may not use run {run!r}: {e.message}", param_hint="--run") from None
    return client, run_id


def _run_by_name(client: StaleFlowClient, name: str) -> int:
    try:
        runs = client.list_runs(limit=1000)
    except Forbidden:
        raise typer.BadParameter("this token may not list runs: pass the run id", param_hint="--run") from None
    for r in runs:
        if r.name == name:
            return r.id
    raise typer.BadParameter(f"no run named {name!r}", param_hint="--run")


def model_config(spec: str | None):
    from workers.models.tiny_model import TinyConfig

    if not spec:
        return TinyConfig()
    try:
        text = Path(spec).read_text() if not spec.lstrip().startswith("{") else spec
        return TinyConfig(**json.loads(text))
    except (OSError, ValueError, TypeError) as e:  # bad path, bad JSON, unknown or bad field
        raise typer.BadParameter(f"{e}", param_hint="--model-config") from None


def ps_client(addr: str | None):
    if addr is None:
        return None
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise typer.BadParameter(f"{addr!r} is not HOST:PORT", param_hint="--ps")
    from workers.trainer.param_server import ParamClient

    # Long-running workers ride through a PS restart (it reloads its versions from disk).
    return ParamClient((host, int(port)), retry_for=None)


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


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(message)}")  # messages may hold [brackets]
    return typer.Exit(1)


# ---- trainer ----------------------------------------------------------------------------------


def trainer(
    run: str = RUN,
    api: list[str] | None = API,
    token: str | None = TOKEN,
    api_wait: float | None = API_WAIT,
    ps: str | None = typer.Option(None, "--ps", help="HOST:PORT of the parameter server (no push without)"),
    checkpoint_dir: Path | None = typer.Option(
        None, "--checkpoint-dir", help="resume state (default: $STALEFLOW_HOME/trainer/run-ID)"
    ),
    steps: int | None = typer.Option(None, "--steps", min=1, help="exit after publishing this many versions"),
    lr: float = typer.Option(1e-3, "--lr", min=0.0, help="AdamW learning rate"),
    weight_decay: float = typer.Option(0.0, "--weight-decay", min=0.0),
    clip_low: float = typer.Option(0.2, "--clip-low", min=0.0, max=0.999, help="PPO ε_low"),
    clip_high: float = typer.Option(0.28, "--clip-high", min=0.0, help="PPO ε_high (clip-higher)"),
    tis_cap: float = typer.Option(2.0, "--tis-cap", min=0.0, help="truncated-IS cap; 0 disables TIS"),
    temperature: float = typer.Option(1.0, "--temperature", min=1e-6, help="the rollout's sampling temperature"),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", min=0.0, help="0 disables clipping"),
    micro_batch_tokens: int = typer.Option(16384, "--micro-batch-tokens", min=1),
    model_config_: str | None = MODEL_CONFIG,
    model_seed: int = MODEL_SEED,
    device: str = typer.Option("cpu", "--device"),
    wait: float = typer.Option(5.0, "--wait", min=0.1, help="long-poll seconds per consume"),
    metrics_file: Path | None = typer.Option(None, "--metrics-file", help="append each step's metrics (JSONL)"),
    sim: bool = typer.Option(False, "--sim", help="no weights, no torch: sleep (a + b·tokens)·scale per step"),
    time_scale: float = typer.Option(1.0, "--time-scale", min=0.0, help="--sim: multiplies every step time"),
    sim_overhead: float | None = typer.Option(None, "--sim-overhead", min=0.0, help="--sim: a, seconds per step"),
    sim_s_per_token: float | None = typer.Option(None, "--sim-s-per-token", min=0.0, help="--sim: b"),
) -> None:
    """Consume ready batches in version order, train (GRPO/DAPO + TIS), push, publish."""
    from workers.trainer import loop, sim_trainer

    cfg = None if sim else model_config(model_config_)
    ps_addr = ps_client(ps) if not sim else None
    client, run_id = connect(api, token, run, api_wait)
    if sim:
        worker: Any = sim_trainer.SimTrainer(
            client,
            run_id,
            time_scale=time_scale,
            wait_s=wait,
            overhead_s=sim_trainer.SIM_OVERHEAD_S if sim_overhead is None else sim_overhead,
            s_per_token=sim_trainer.SIM_S_PER_TOKEN if sim_s_per_token is None else sim_s_per_token,
        )
    else:
        worker = _torch_trainer(
            client,
            run_id,
            cfg,
            ps_addr,
            checkpoint_dir,
            lr,
            weight_decay,
            clip_low,
            clip_high,
            tis_cap,
            temperature,
            max_grad_norm,
            micro_batch_tokens,
            model_seed,
            device,
            wait,
        )
    on_signals(worker.stop, "finishing the current step")
    with progress(steps, f"trainer run {run_id}: waiting for a batch") as (bar, task):

        def on_step(m: Any) -> None:
            bar.update(task, advance=1, description=escape(f"trainer run {run_id}: {m.line()}"))
            if metrics_file is not None:
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(m.to_json()) + "\n")

        try:
            done = worker.run(steps=steps, on_step=on_step)
        except (loop.TrainerError, ApiError) as e:
            raise _fail(str(e)) from None
    console.print(
        f"trainer: {len(done)} step(s) published; run {run_id} at version {client.run_status(run_id).version}"
    )


def _torch_trainer(
    client,
    run_id,
    cfg,
    ps_addr,
    checkpoint_dir,
    lr,
    weight_decay,
    clip_low,
    clip_high,
    tis_cap,
    temperature,
    max_grad_norm,
    micro_batch_tokens,
    model_seed,
    device,
    wait,
):
    import torch

    from workers.models.tiny_model import TinyTransformer
    from workers.trainer.grpo import GRPOConfig
    from workers.trainer.torch_trainer import Trainer

    directory = checkpoint_dir or get_settings().home / "trainer" / f"run-{run_id}"
    model = TinyTransformer(cfg, seed=model_seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    grpo = GRPOConfig(clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap or None, temperature=temperature)
    where = f"{ps_addr.addr[0]}:{ps_addr.addr[1]}" if ps_addr else "none"
    console.print(escape(f"trainer: checkpoints in {directory}; PS {where}"))
    return Trainer(
        client,
        run_id,
        model,
        opt,
        ps=ps_addr,
        checkpoint_dir=directory,
        grpo=grpo,
        wait_s=wait,
        micro_batch_tokens=micro_batch_tokens,
        max_grad_norm=max_grad_norm or None,
        extra_state={"model_config": cfg.to_dict(), "model_seed": model_seed},
    )


# ---- parameter server -------------------------------------------------------------------------


def ps(
    data_dir: Path = typer.Option(..., "--data-dir", help="where versions are persisted (safetensors)"),
    port: int = typer.Option(8790, "--port", min=0, max=65535, help="control port; 0 picks a free one"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    backend: Backend = typer.Option(Backend.gloo, "--backend", help="gloo (CPU) or nccl (GPU) transfers"),
    device: str | None = typer.Option(
        None, "--device", help="where the PS keeps weights (default: cpu; cuda for nccl)"
    ),
    ready_file: Path | None = typer.Option(None, "--ready-file", help="write {host, port, pid} here once serving"),
) -> None:
    """Serve weight versions: the trainer pushes, rollout workers pull (until SIGTERM)."""
    import torch

    from workers.trainer.param_server import main

    if backend is Backend.nccl and not torch.cuda.is_available():
        raise typer.BadParameter("nccl needs CUDA GPUs; use --backend gloo on CPU", param_hint="--backend")
    main(
        data_dir,
        host,
        port,
        backend=backend.value,
        device=device or ("cuda" if backend is Backend.nccl else "cpu"),
        ready_file=ready_file,
    )


# ---- rollout worker ---------------------------------------------------------------------------


def rollout_worker(
    run: str = RUN,
    engine: Engine = typer.Option(..., "--engine", help="torch (tiny model, CPU/GPU), sim (cost model) or vllm"),
    api: list[str] | None = API,
    token: str | None = TOKEN,
    api_wait: float | None = API_WAIT,
    ps: str | None = typer.Option(None, "--ps", help="HOST:PORT of the PS to pull weights from"),
    name: str | None = typer.Option(None, "--name", help="instance label (default: host-pid)"),
    kv_capacity: int | None = typer.Option(
        None, "--kv-capacity", min=16, help="KV-cache tokens (torch: default 8192; sim: the engine's)"
    ),
    phi_wait: int | None = typer.Option(
        None, "--phi-wait", min=0, help="interrupt a preempted sample when more than this many wait"
    ),
    max_running: int = typer.Option(256, "--max-running", min=1),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0),
    model_config_: str | None = MODEL_CONFIG,
    model_seed: int = MODEL_SEED,
    device: str = typer.Option("cpu", "--device", help="torch engine device"),
    vllm_model: str | None = typer.Option(None, "--vllm-model", help="vllm: model name or path"),
    sim_model: str | None = typer.Option(None, "--sim-model", help="sim: cost model (cost_models.json), e.g. qwen_7b"),
    sim_parallelism: str | None = typer.Option(None, "--sim-parallelism", help="sim: e.g. TP1_PP1"),
    time_scale: float | None = typer.Option(
        None, "--time-scale", min=0.0, help="sim: wall seconds per simulated second"
    ),
    heartbeat: float = typer.Option(1.0, "--heartbeat", min=0.05, help="seconds between snapshots"),
    ps_wait: float = typer.Option(120.0, "--ps-wait", min=0.0, help="seconds to wait for the PS's first version"),
) -> None:
    """Serve routed samples on one engine; report segments; pull weights when told."""
    from workers.rollout.worker import RolloutWorker

    cfg = model_config(model_config_) if engine is Engine.torch else None
    if engine is Engine.vllm and not vllm_model:
        raise typer.BadParameter("--engine vllm needs --vllm-model", param_hint="--vllm-model")
    cost = _cost_model(sim_model, sim_parallelism) if engine is Engine.sim else None
    pc = ps_client(ps)
    client, run_id = connect(api, token, run, api_wait)
    if engine is Engine.sim:
        eng, weights = _sim_engine(client, run_id, kv_capacity, max_running, cost, time_scale)
    else:
        eng, weights = _engine(
            engine, pc, cfg, model_seed, kv_capacity or 8192, max_running, temperature, device, vllm_model, ps_wait
        )
    worker = RolloutWorker(
        client,
        run_id,
        eng,
        name=name or f"{socket.gethostname()}-{os.getpid()}",
        weights=weights,
        phi_wait=phi_wait,
        heartbeat_s=heartbeat,
    )
    on_signals(worker.stop, "flushing reports and deregistering")
    with progress(None, f"rollout run {run_id}: starting") as (bar, task):
        last = [0.0]

        def show() -> bool:
            if time.monotonic() - last[0] >= 1.0:
                s = worker.stats
                bar.update(
                    task,
                    description=(
                        f"rollout {worker.instance_id} v{eng.version}: routed {s.routed} finished {s.finished} "
                        f"interrupted {s.interrupted} tokens {s.tokens} pulls {s.pulls}"
                        f"{' (API unavailable)' if client.api.down else ''}"
                    ),
                )
                last[0] = time.monotonic()
            return False

        try:
            stats = worker.run(until=show)
        finally:
            if hasattr(eng, "shutdown"):  # vLLM runs its engine core in another process
                eng.shutdown()
    console.print(f"rollout worker: {stats.finished} finished, {stats.tokens} tokens, deregistered")


def _cost_model(model: str | None, parallelism: str | None):
    if model is None:
        return None  # the sim engine's default (STALEFLOW_SIM_MODEL, else qwen_7b)
    from workers.coordinator.cost_model import get_cost_model

    try:
        return get_cost_model(model, parallelism)
    except KeyError as e:
        raise typer.BadParameter(str(e.args[0]), param_hint="--sim-model") from None


def _sim_engine(client, run_id, kv_capacity, max_running, cost, time_scale):
    """The cost-model engine: no weights, so a pull only moves its version on."""
    try:
        mod = importlib.import_module("workers.rollout.engines.sim_engine")
    except ModuleNotFoundError as e:
        if e.name != "workers.rollout.engines.sim_engine":
            raise
        raise typer.BadParameter(
            "the sim engine (workers/rollout/engines/sim_engine.py) is not in this installation", param_hint="--engine"
        ) from None
    kw: dict[str, Any] = {
        "cost": cost,
        "max_running": max_running,
        "time_scale": time_scale,
        "version": client.run_status(run_id).version,
    }
    if kv_capacity is not None:
        kw["kv_capacity_tokens"] = kv_capacity
    eng = mod.SimEngine(**kw)
    return eng, lambda target: (None, target if target is not None else client.run_status(run_id).version)


def _engine(kind, pc, cfg, model_seed, kv_capacity, max_running, temperature, device, vllm_model, ps_wait):
    """(engine, weight source) for the torch and vllm engines."""
    if kind is Engine.torch:
        from workers.rollout.engines.torch_engine import TorchEngine

        eng = TorchEngine(
            cfg,
            model_seed=model_seed,
            kv_capacity_tokens=kv_capacity,
            max_running=max_running,
            temperature=temperature,
            device=device,
        )
    else:
        from workers.rollout.engines.vllm_engine import VLLMEngine, VLLMUnavailable

        try:
            eng = VLLMEngine(vllm_model, temperature=temperature, max_num_seqs=max_running)
        except VLLMUnavailable as e:
            raise _fail(str(e)) from None
    if pc is not None:
        eng.load_weights(*_first_weights(pc, ps_wait))
    else:
        console.print("[yellow]no --ps: serving the initial weights; pull commands change nothing")
    return eng, (lambda target: _pull(pc, target)) if pc is not None else None


def _first_weights(pc, wait_s: float):
    """The latest COMMITTED version: the PS serves plain pulls only from committed weights."""
    from workers.trainer.param_server import ChecksumError, ParamServerError

    def give_up(state: RetryCallState) -> None:
        raise _fail(
            f"the PS at {pc.addr[0]}:{pc.addr[1]} served no committed version within "
            f"{wait_s:.0f}s (the trainer pushes and commits version 0 when it starts)"
        )

    # A ParamServerError other than a checksum mismatch means nothing is committed yet.
    nothing_yet = retry_if_exception(lambda e: isinstance(e, ParamServerError) and not isinstance(e, ChecksumError))
    with console.status(f"waiting for the PS at {pc.addr[0]}:{pc.addr[1]} to serve a committed version"):
        # pc.pull() itself waits while the PS is not listening yet.
        sd, version, _ = Retrying(
            retry=nothing_yet, stop=stop_after_delay(wait_s), wait=wait_fixed(0.5), retry_error_callback=give_up
        )(pc.pull)
        return sd, version


def _pull(pc, target: int | None):
    """Weights for a pull command. The PS serves `target` only once it is committed (its
    checksum is the published one); before that -- or once the PS dropped it for a newer
    one -- the latest committed version, so an instance never loads unpublished weights
    (e.g. a fenced trainer's push under a published number, before the winner's commit)."""
    from workers.trainer.param_server import ChecksumError, ParamServerError

    try:
        sd, version, _ = pc.pull(target)
    except ChecksumError:
        raise
    except ParamServerError:
        sd, version, _ = pc.pull()
    return sd, version


# ---- reward worker ----------------------------------------------------------------------------


def reward_worker(
    run: str = RUN,
    verifier: str = typer.Option(..., "--verifier", help="a verifier of workers/tasks/verifiers.py: repeat, math, ..."),
    api: list[str] | None = API,
    token: str | None = TOKEN,
    api_wait: float | None = API_WAIT,
    batch: int = typer.Option(256, "--batch", min=1, help="samples claimed per request"),
    lease: float = typer.Option(60.0, "--lease", min=1.0, help="seconds a claim is held"),
) -> None:
    """Claim finished samples, score them with a rule-based verifier, post the rewards."""
    from workers.reward.worker import RewardWorker
    from workers.tasks.verifiers import VERIFIERS

    if verifier not in VERIFIERS:
        raise typer.BadParameter(
            f"unknown verifier {verifier!r} (known: {', '.join(sorted(VERIFIERS))})", param_hint="--verifier"
        )
    client, run_id = connect(api, token, run, api_wait)
    worker = RewardWorker(client, run_id, verifier, batch=batch, lease_s=lease)
    on_signals(worker.stop, "posting the rewards in hand")
    with progress(None, f"reward run {run_id}: waiting for samples") as (bar, task):

        def until() -> bool:
            s = worker.stats
            mean = s.reward_sum / s.scored if s.scored else 0.0
            bar.update(
                task,
                description=f"reward run {run_id}: scored {s.scored} (mean {mean:.3f}) "
                f"groups {s.groups_occupied} filtered {s.groups_filtered}",
            )
            return False

        try:
            stats = worker.run(until=until)
        except ApiError as e:
            raise _fail(str(e)) from None
    console.print(f"reward worker: {stats.scored} scored")
