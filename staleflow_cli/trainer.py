"""``staleflow trainer`` and ``staleflow ps``: the training side (docs in staleflow_cli/common.py)."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from staleflow_cli.common import (
    API,
    API_WAIT,
    HF_MODEL,
    MODEL_CONFIG,
    MODEL_SEED,
    RUN,
    TOKEN,
    connect,
    console,
    fail,
    hf_folder,
    model_config,
    need,
    on_signals,
    progress,
    ps_client,
    ps_login,
    run_sampling,
    torch_device,
)
from workers.client import ApiError, Forbidden, StaleFlowClient
from workers.settings import home_dir
from workers.trainer.options import SimOptions, TrainerOptions

if TYPE_CHECKING:  # torch-backed: imported where used (the --sim trainer runs without torch)
    import torch

    from workers.models.tiny_model import TinyConfig
    from workers.trainer.param_client import ParamClient
    from workers.trainer.torch_trainer import Trainer


class Backend(str, enum.Enum):
    gloo = "gloo"
    nccl = "nccl"


# ---- trainer ----------------------------------------------------------------------------------


def trainer(
    run: str | None = typer.Option(None, "--run", help="run id or name (an --offline trainer trains without one)"),
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
    temperature: float | None = typer.Option(
        None, "--temperature", min=1e-6, help="the run's sampling temperature is used; a different one is refused"
    ),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", min=0.0, help="0 disables clipping"),
    micro_batch_tokens: int = typer.Option(16384, "--micro-batch-tokens", min=1),
    ppo_epochs: int = typer.Option(1, "--ppo-epochs", min=1, help="passes over each batch (PPO epochs)"),
    minibatches: int = typer.Option(1, "--minibatches", min=1, help="optimizer steps per pass (split by group)"),
    model_config_: str | None = MODEL_CONFIG,
    model_seed: int = MODEL_SEED,
    model: Path | None = HF_MODEL,
    init_weights: Path | None = typer.Option(
        None, "--init-weights", help="a torch state dict for the tiny model's version 0 (e.g. a warm start)"
    ),
    lr_end: float = typer.Option(1.0, "--lr-end", min=0.0, help="lr multiplier reached linearly at --steps"),
    device: str = typer.Option("cpu", "--device"),
    push_dtype: str = typer.Option(
        "auto",
        "--push-dtype",
        help="what weights travel to the PS as: auto (bfloat16 on a GPU, the parameters' dtype on a CPU), "
        "bfloat16, float16 or float32; never wider than the parameters",
    ),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: torch's default)"),
    wait: float = typer.Option(5.0, "--wait", min=0.1, help="long-poll seconds per consume"),
    metrics_file: Path | None = typer.Option(None, "--metrics-file", help="append each step's metrics (JSONL)"),
    save_every: int = typer.Option(
        0, "--save-every", min=0, help="keep the checkpoint of every N-th version (versions/vN.pt, for replay)"
    ),
    offline: Path | None = typer.Option(
        None, "--offline", help="train on an export's batches in step order (no API, no PS, nothing published)"
    ),
    sim: bool = typer.Option(False, "--sim", help="no weights, no torch: sleep (a + b·tokens)·scale per step"),
    time_scale: float = typer.Option(1.0, "--time-scale", min=0.0, help="--sim: multiplies every step time"),
    sim_overhead: float | None = typer.Option(None, "--sim-overhead", min=0.0, help="--sim: a, seconds per step"),
    sim_s_per_token: float | None = typer.Option(None, "--sim-s-per-token", min=0.0, help="--sim: b"),
) -> None:
    """Consume ready batches in version order, train (GRPO/DAPO + TIS), push, publish; or, with
    --offline EXPORT, train on an export's batches in step order (no run needed)."""
    if model is not None and (sim or model_config_):
        raise typer.BadParameter(
            "--model trains a Hugging Face model: no --sim, no --model-config", param_hint="--model"
        )
    try:
        opts = TrainerOptions(
            steps=steps,
            wait_s=wait,
            checkpoint_dir=checkpoint_dir,
            metrics_file=metrics_file,
            save_every=save_every,
            offline=offline,
            lr=lr,
            lr_end=lr_end,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            clip_low=clip_low,
            clip_high=clip_high,
            tis_cap=tis_cap,
            micro_batch_tokens=micro_batch_tokens,
            ppo_epochs=ppo_epochs,
            minibatches=minibatches,
            device=device,
            push_dtype=push_dtype,
            threads=threads,
            sim=SimOptions(time_scale, sim_overhead, sim_s_per_token) if sim else None,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if not sim:
        torch_device(device)
    if opts.offline is not None and (run is not None or ps is not None):
        raise typer.BadParameter("an --offline trainer reaches no run: no --run, no --ps", param_hint="--offline")
    if opts.offline is None and run is None:
        raise typer.BadParameter("Missing option '--run' (or --offline EXPORT)", param_hint="--run")
    cfg = None if sim or model is not None else model_config(model_config_)
    if model is not None:
        hf_folder(model)
    if opts.threads and opts.sim is None:
        import torch

        # on a CPU shared with rollout workers, extra threads spin against them: measured
        # 4-8x slower GRPO updates with 2 threads than with 1 on a loaded 2-core machine
        torch.set_num_threads(opts.threads)
    if opts.offline is not None:
        from staleflow_cli.trainer_offline import train_offline

        train_offline(opts, cfg, model, model_seed, init_weights, temperature)
        return
    ps_addr = ps_client(ps) if opts.sim is None else None
    assert run is not None  # refused above without --offline
    client, run_id = connect(api, token, run, api_wait)
    run_t, top_p = run_sampling(client, run_id, temperature)
    if top_p < 1 and opts.sim is None:
        raise fail(
            f"run {run_id} samples with top_p {top_p:g}: this trainer's loss has no nucleus truncation, so its "
            "log-probs would not be the engines'; train it with the SDK (Batch.top_p)"
        )
    opts = dataclasses.replace(opts, temperature=run_t)
    ps_login(ps_addr, client, run_id, "trainer")
    if opts.sim is not None:
        worker: Any = _sim_trainer(client, run_id, opts, opts.sim)
    else:
        built = _build_model(cfg, model, model_seed, opts.device, init_weights)
        worker = _torch_trainer(client, run_id, built, ps_addr, opts)
    _run_trainer(worker, client, run_id, opts)


def _run_trainer(worker: Any, client: StaleFlowClient, run_id: int, opts: TrainerOptions) -> None:
    """Steps until `opts.steps` versions are published (or a signal), with progress."""
    from workers.trainer import loop

    on_signals(worker.stop, "finishing the current step")
    with progress(opts.steps, f"trainer run {run_id}: waiting for a batch") as (bar, task):

        def on_step(m: Any) -> None:
            bar.update(task, advance=1, description=escape(f"trainer run {run_id}: {m.line()}"))
            if opts.metrics_file is not None:
                with open(opts.metrics_file, "a") as f:
                    f.write(json.dumps(m.to_json()) + "\n")

        try:
            done = worker.run(steps=opts.steps, on_step=on_step)
        except (loop.TrainerError, ApiError) as e:
            raise fail(str(e)) from None
    console.print(
        f"trainer: {len(done)} step(s) published; run {run_id} at version {client.run_status(run_id).version}"
    )


def _sim_trainer(client: StaleFlowClient, run_id: int, opts: TrainerOptions, sim: SimOptions) -> Any:
    from workers.trainer import sim_trainer

    return sim_trainer.SimTrainer(
        client,
        run_id,
        time_scale=sim.time_scale,
        wait_s=opts.wait_s,
        overhead_s=sim_trainer.SIM_OVERHEAD_S if sim.overhead_s is None else sim.overhead_s,
        s_per_token=sim_trainer.SIM_S_PER_TOKEN if sim.s_per_token is None else sim.s_per_token,
    )


def _build_model(
    cfg: TinyConfig | None, folder: Path | None, model_seed: int, device: str, init: Path | None = None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model to train and what its checkpoint records about it: a Hugging Face folder
    (`--model`, its weights are version 0) or the tiny model (`--model-config`, seeded, or
    `--init-weights` for version 0; a resumed run's checkpoint replaces either)."""
    if folder is not None:
        from workers.models.hf import load_model

        return load_model(folder, device), {"model_path": str(folder.resolve())}
    from workers.models.tiny_model import TinyTransformer

    assert cfg is not None  # trainer() builds one unless --model or --sim
    tiny = TinyTransformer(cfg, seed=model_seed)
    if init is not None:
        import torch

        tiny.load_state_dict(torch.load(init, map_location="cpu", weights_only=True))
    return tiny.to(device), {"model_config": cfg.to_dict(), "model_seed": model_seed}


def _torch_trainer(
    client: StaleFlowClient,
    run_id: int,
    built: tuple[torch.nn.Module, dict[str, Any]],
    ps_addr: ParamClient | None,
    opts: TrainerOptions,
) -> Trainer:
    import torch

    from workers.trainer.torch_trainer import Trainer

    directory = opts.checkpoint_dir or home_dir() / "trainer" / f"run-{run_id}"
    model, extra_state = built
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    where = f"{ps_addr.addr[0]}:{ps_addr.addr[1]}" if ps_addr else "none"
    console.print(escape(f"trainer: checkpoints in {directory}; PS {where}"))
    return Trainer(
        client,
        run_id,
        model,
        opt,
        ps=ps_addr,
        checkpoint_dir=directory,
        grpo=opts.grpo(),
        wait_s=opts.wait_s,
        micro_batch_tokens=opts.micro_batch_tokens,
        max_grad_norm=opts.max_grad_norm or None,
        extra_state=extra_state,
        ppo_epochs=opts.ppo_epochs,
        minibatches=opts.minibatches,
        lr_scale=opts.lr_scale(),
        push_dtype=getattr(torch, name) if (name := opts.push_dtype_name()) else None,
        save_every=opts.save_every,
    )


# ---- parameter server -------------------------------------------------------------------------


def ps(
    run: str = RUN,
    api: list[str] | None = API,
    token: str | None = TOKEN,
    api_wait: float | None = API_WAIT,
    data_dir: Path = typer.Option(..., "--data-dir", help="where versions are persisted (safetensors)"),
    port: int = typer.Option(8790, "--port", min=0, max=65535, help="control port; 0 picks a free one"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    backend: Backend = typer.Option(Backend.gloo, "--backend", help="gloo (CPU) or nccl (GPU) transfers"),
    device: str | None = typer.Option(
        None, "--device", help="where the PS keeps weights (default: cpu; cuda for nccl)"
    ),
    ready_file: Path | None = typer.Option(None, "--ready-file", help="write {host, port, pid} here once serving"),
) -> None:
    """Serve the run's weight versions: its trainer pushes, its rollout workers pull (until
    SIGTERM). Every connection must prove the run's PS key for its role (docs/security.md):
    the PS gets the keys from the API with a trainer (or admin) token."""
    need("torch")
    import torch

    from workers.trainer.param_auth import PSAuthError, PSKeys
    from workers.trainer.param_server import main

    if backend is Backend.nccl and not torch.cuda.is_available():
        raise typer.BadParameter("nccl needs CUDA GPUs; use --backend gloo on CPU", param_hint="--backend")
    client, run_id = connect(api, token, run, api_wait)
    try:
        keys = PSKeys.fetch(client, run_id)
    except (Forbidden, PSAuthError) as e:
        raise fail(f"the parameter server needs the run's keys (a trainer or admin token): {e}") from None
    finally:
        client.close()
    main(
        data_dir,
        host,
        port,
        backend=backend.value,
        device=device or ("cuda" if backend is Backend.nccl else "cpu"),
        ready_file=ready_file,
        auth=keys,
    )
