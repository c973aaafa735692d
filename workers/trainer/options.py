"""What `staleflow trainer` is told, as one validated object: the command parses its flags into
a `TrainerOptions` and hands that on, so the torch trainer, the sim trainer and the optimizer
are built from one place. Torch-free: the sim trainer and `--help` never import torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.trainer.grpo import GRPOConfig


PUSH_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class SimOptions:
    """`--sim`: no weights; each step sleeps (overhead_s + s_per_token · tokens) · time_scale."""

    time_scale: float = 1.0
    overhead_s: float | None = None  # None: the sim trainer's default
    s_per_token: float | None = None


@dataclass(frozen=True)
class TrainerOptions:
    steps: int | None = None  # exit after publishing this many versions (None: for ever)
    wait_s: float = 5.0  # long-poll seconds per consume
    checkpoint_dir: Path | None = None  # None: $STALEFLOW_HOME/trainer/run-ID
    metrics_file: Path | None = None  # each step's metrics appended as JSON lines
    save_every: int = 0  # keep the checkpoint of every N-th version (versions/vK.pt); 0: only the latest
    offline: Path | None = None  # an export folder: train on its batches, no run, nothing published
    # optimizer
    lr: float = 1e-3
    lr_end: float = 1.0  # lr multiplier reached linearly at `steps`
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping
    # GRPO / DAPO loss
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0  # 0 disables truncated importance sampling
    temperature: float = 1.0  # the rollout's sampling temperature
    # how each batch is used
    micro_batch_tokens: int = 16384
    ppo_epochs: int = 1
    minibatches: int = 1
    # where it runs
    device: str = "cpu"
    # what the weights travel as: "auto" = bfloat16 on a GPU, the parameters' own dtype on a
    # CPU; or a floating dtype's name (never wider than the parameters: see param_store)
    push_dtype: str = "auto"
    threads: int = 0  # torch CPU threads (0: torch's default)
    sim: SimOptions | None = None  # set: the sim trainer, no torch

    def __post_init__(self) -> None:
        if self.lr_end != 1.0 and self.steps is None:
            raise ValueError("--lr-end decays over --steps: give --steps")
        if self.offline is not None and self.sim is not None:
            raise ValueError("--offline trains the torch trainer: no --sim")
        if self.push_dtype not in PUSH_DTYPES:
            raise ValueError(f"--push-dtype {self.push_dtype!r}: one of {', '.join(PUSH_DTYPES)}")

    def push_dtype_name(self) -> str | None:
        """The torch dtype name the trainer pushes in; None: the parameters' own."""
        if self.push_dtype == "auto":
            return "bfloat16" if self.device.startswith("cuda") else None
        return self.push_dtype

    def grpo(self) -> GRPOConfig:
        from workers.trainer.grpo import GRPOConfig

        return GRPOConfig(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            tis_cap=self.tis_cap or None,
            temperature=self.temperature,
        )

    def lr_scale(self) -> Callable[[int], float] | None:
        """lr x 1 at version 0 down to lr x lr_end at version steps - 1 (then flat): a decaying
        lr lets the policy settle by the end of a fixed budget. None when there is no decay."""
        if self.lr_end == 1.0:
            return None
        steps, lr_end = self.steps, self.lr_end
        assert steps is not None  # __post_init__
        return lambda v: 1.0 + (lr_end - 1.0) * min(v, steps - 1) / max(1, steps - 1)
