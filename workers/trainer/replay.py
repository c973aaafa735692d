"""`staleflow replay`: recompute a trained step's loss from an export and the checkpoint the step
started from, with the trainer's own code (`Trainer.train_batch`, i.e. grpo.grpo_update).

Step S trains model version S into S + 1. Its checkpoint (`versions/vS.pt`, kept by
`staleflow trainer --save-every`) holds the weights and optimizer state the step started
from and how it trains (`train`: the GRPO settings, lr, epochs x minibatches, micro-batch
budget); the export holds the batch (workers/export_read.py) and, in steps.jsonl, what the
trainer published with version S + 1: its checksum and the step's loss (the trainer's own
steps.jsonl beside its checkpoints has both too: `--steps-log`). The replay runs the whole
update again on a copy, so with several optimizer steps per batch (their mean is the logged
loss) it is exact too, and the weights it ends with must have the published checksum."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.export_read import Export
from workers.trainer.grpo import GRPOConfig
from workers.trainer.param_store import state_dict_checksum
from workers.trainer.torch_trainer import STEPS_LOG, VERSIONS, Trainer
from workers.wire.models import BatchOut


class ReplayError(ValueError):
    """The checkpoint does not fit the export or the step; the message says how."""


@dataclass
class Replayed:
    step: int
    samples: int
    response_tokens: int
    loss: float
    logged_loss: float | None  # None: no trained line with a loss for this step in the steps log
    checksum: str  # of the weights the replayed update ends with
    logged_checksum: str | None
    metrics: dict[str, float]
    logged_in: str | None = None  # where the logged loss was read

    @property
    def diff(self) -> float | None:
        return None if self.logged_loss is None else self.loss - self.logged_loss

    def line(self) -> str:
        if self.logged_loss is None:
            logged = " logged loss: none (neither the export nor a steps log beside the checkpoint has it)"
        else:
            logged = f" logged {self.logged_loss:+.8f} diff {self.diff:+.2e} ({self.logged_in})"
        weights = ""
        if self.logged_checksum is not None:
            same = "same as" if self.checksum == self.logged_checksum else "DIFFERENT from"
            weights = f"; weights after {self.checksum[:12]} {same} v{self.step + 1}'s"
        return f"step {self.step}: {self.samples} samples, loss {self.loss:+.8f}{logged}{weights}"

    def matches(self, rel: float = 1e-5, abs_: float = 1e-6) -> bool:
        return self.logged_loss is not None and math.isclose(self.loss, self.logged_loss, rel_tol=rel, abs_tol=abs_)


def load_step_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint file (`versions/vS.pt`, or the trainer's `trainer.pt`)."""
    if path.is_dir():
        raise ReplayError(f"{path} is a folder: give the checkpoint file of the step (its {VERSIONS}/vS.pt)")
    if not path.is_file():
        raise ReplayError(f"no checkpoint at {path}")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds on a file that is not its own
        raise ReplayError(f"{path} is not a trainer checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict) or not {"model", "optimizer", "version", "run_id"} <= set(ck):
        raise ReplayError(f"{path} is not a trainer checkpoint (no model, optimizer, version and run id)")
    return ck


def build_model(ck: dict[str, Any], device: str = "cpu") -> nn.Module:
    """The model the checkpoint's trainer trained (its record: the tiny model's config or the
    Hugging Face folder), holding the checkpoint's weights."""
    if "model_config" in ck:
        from workers.models.tiny_model import TinyConfig, TinyTransformer

        model: nn.Module = TinyTransformer(TinyConfig(**ck["model_config"]))
    elif "model_path" in ck:
        from workers.models.hf import load_model

        model = load_model(ck["model_path"])
    else:
        raise ReplayError("the checkpoint names no model (neither model_config nor model_path)")
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise ReplayError(f"the checkpoint's weights do not fit its model: {e}") from None
    return model.to(device)


def replay(export: Export, step: int, checkpoint: Path, steps_log: Path | None = None, device: str = "cpu") -> Replayed:
    """Train step `step` of the export again from `checkpoint` (on a copy: nothing is written)."""
    batch = export.batch(step)
    ck = load_step_checkpoint(checkpoint)
    if int(ck["run_id"]) != export.run_id:
        raise ReplayError(f"{checkpoint} is a checkpoint of run {ck['run_id']}, the export is of run {export.run_id}")
    if int(ck["version"]) != step:
        raise ReplayError(
            f"{checkpoint} holds model version {ck['version']}; step {step} trains version {step}: "
            f"give {VERSIONS}/v{step}.pt (kept by staleflow trainer --save-every)"
        )
    train = ck.get("train")
    if train is None:
        raise ReplayError(f"{checkpoint} does not say how its step trains (a checkpoint of an older trainer)")
    push_dtype = getattr(torch, train["push_dtype"]) if train.get("push_dtype") else None
    if train.get("threads"):
        torch.set_num_threads(train["threads"])  # the trainer's reduction order, bit for bit
    model = build_model(ck, device)
    if state_dict_checksum(model.state_dict(), push_dtype) != ck["checksum"]:
        raise ReplayError(f"{checkpoint}: its weights do not match its own checksum (a damaged file)")
    published = export.published(step - 1) if step > 0 and not ck.get("offline") else None
    if published is not None and published.get("checksum") not in (None, ck["checksum"]):
        raise ReplayError(
            f"{checkpoint} holds weights {ck['checksum'][:12]}, not those published as version {step} "
            f"({published['checksum'][:12]}): a checkpoint of another trainer or model"
        )
    optimizer = getattr(torch.optim, train["optimizer"])(model.parameters())
    optimizer.load_state_dict(ck["optimizer"])  # lr, betas, weight decay and moments as trained
    if train.get("lrs") is not None:
        for group, lr in zip(optimizer.param_groups, train["lrs"]):
            group["lr"] = lr
    trainer = Trainer(
        None,  # type: ignore[arg-type]  # train_batch reaches no API
        export.run_id,
        model,
        optimizer,
        checkpoint_dir=checkpoint.parent,
        grpo=GRPOConfig(**train["grpo"]),
        micro_batch_tokens=train["micro_batch_tokens"],
        max_grad_norm=train["max_grad_norm"],
        ppo_epochs=train["ppo_epochs"],
        minibatches=train["minibatches"],
    )
    loss, metrics = trainer.train_batch(batch)
    logged, logged_in = _logged(export, step, steps_log or _default_log(checkpoint), steps_log is not None)
    return Replayed(
        step=step,
        samples=sum(len(g.samples) for g in batch.groups),
        response_tokens=sum(len(s.tokens) for g in batch.groups for s in g.samples),
        loss=loss,
        logged_loss=None if logged is None else logged.get("loss"),
        checksum=state_dict_checksum(model.state_dict(), push_dtype),
        logged_checksum=None if logged is None else logged.get("checksum"),
        metrics=metrics,
        logged_in=logged_in,
    )


def batch_summary(batch: BatchOut) -> str:
    samples = [s for g in batch.groups for s in g.samples]
    stale: dict[int, int] = {}
    for s in samples:
        stale[batch.version - s.v_traj] = stale.get(batch.version - s.v_traj, 0) + 1
    return (
        f"step {batch.version}: {len(batch.groups)} groups, {len(samples)} samples, "
        f"{sum(len(s.tokens) for s in samples)} response tokens, "
        f"reward mean {sum(s.reward for s in samples) / max(len(samples), 1):.4f}, "
        f"staleness [{' '.join(f'{k}:{v}' for k, v in sorted(stale.items()))}]"
    )


def _default_log(checkpoint: Path) -> Path:
    """steps.jsonl of the trainer directory the checkpoint is in (kept ones are in versions/)."""
    here = checkpoint.parent
    return here.parent / STEPS_LOG if here.name == VERSIONS else here / STEPS_LOG


def _logged(export: Export, step: int, log: Path, named: bool) -> tuple[dict[str, Any] | None, str | None]:
    """The loss the trainer logged for `step` and the checksum of the version it trained, and
    where they were read: the export (published with the version) unless a steps log is
    named; else the trainer's steps.jsonl beside the checkpoint."""
    published = None if named else export.published(step)
    if published is not None and (published.get("train_metrics") or {}).get("loss") is not None:
        return {"loss": published["train_metrics"]["loss"], "checksum": published["checksum"]}, "export"
    if not log.is_file():
        if named:
            raise ReplayError(f"no steps log at {log}")
        return None, None
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    trained = [e for e in lines if e.get("event") == "trained" and e.get("buffer") == step]
    if not trained or trained[-1].get("loss") is None:
        return None, None
    return trained[-1], str(log)
