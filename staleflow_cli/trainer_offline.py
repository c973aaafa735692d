"""``staleflow trainer --offline EXPORT``: the torch trainer on an export's batches (workers/trainer/offline.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from staleflow_cli.common import console, fail, on_signals, progress, sampling_of
from workers.settings import home_dir
from workers.trainer.options import TrainerOptions

if TYPE_CHECKING:
    from workers.models.tiny_model import TinyConfig


def train_offline(
    opts: TrainerOptions,
    cfg: TinyConfig | None,
    model: Path | None,
    model_seed: int,
    init_weights: Path | None,
    temperature: float | None,
) -> None:
    """Train every step of the export (or the first --steps of those left), checkpointing each."""
    import dataclasses

    import torch

    from staleflow_cli.trainer import _build_model
    from workers.export_read import Export, ExportError
    from workers.trainer.loop import StepMetrics, TrainerError
    from workers.trainer.offline import OfflineTrainer, offline_directory

    assert opts.offline is not None
    try:
        export = Export(opts.offline)
        steps = export.steps()
    except ExportError as e:
        raise typer.BadParameter(str(e), param_hint="--offline") from None
    if not steps:
        raise typer.BadParameter(f"{opts.offline} holds no trained step", param_hint="--offline")
    run_t, top_p = sampling_of(export.config, export.run_id, temperature)
    if top_p < 1:
        raise fail(f"run {export.run_id} samples with top_p {top_p:g}: this trainer's loss has no nucleus truncation")
    opts = dataclasses.replace(opts, temperature=run_t)
    built_model, extra_state = _build_model(cfg, model, model_seed, opts.device, init_weights)
    directory = opts.checkpoint_dir or offline_directory(home_dir(), export.run_id)
    console.print(
        escape(f"trainer: offline from {opts.offline} (steps {steps[0]}..{steps[-1]}); checkpoints in {directory}")
    )
    opt = torch.optim.AdamW(built_model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    worker = OfflineTrainer(
        export,
        built_model,
        opt,
        checkpoint_dir=directory,
        grpo=opts.grpo(),
        micro_batch_tokens=opts.micro_batch_tokens,
        max_grad_norm=opts.max_grad_norm or None,
        extra_state=extra_state,
        ppo_epochs=opts.ppo_epochs,
        minibatches=opts.minibatches,
        lr_scale=opts.lr_scale(),
        save_every=opts.save_every,
    )
    on_signals(worker.stop, "finishing the current step")
    with progress(opts.steps or len(steps), f"trainer offline run {export.run_id}") as (bar, task):

        def on_step(m: StepMetrics) -> None:
            bar.update(task, advance=1, description=escape(f"trainer offline: {m.line()}"))
            if opts.metrics_file is not None:
                with open(opts.metrics_file, "a") as f:
                    f.write(json.dumps(m.to_json()) + "\n")

        try:
            done = worker.run(steps=opts.steps, on_step=on_step)
        except (TrainerError, ExportError) as e:
            raise fail(str(e)) from None
    last = done[-1].loss if done else None
    tail = "" if last is None else f"; last loss {last:+.6f}"
    console.print(f"trainer: {len(done)} step(s) trained offline; model at version {worker.version}{tail}")
