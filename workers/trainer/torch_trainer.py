"""The trainer: consume the ready buffer of its version, take one GRPO/DAPO step, checkpoint,
push the new weights to the PS, publish.

Per version v (the run's current version):
    consume(v) -> batch with a consume fence -> one optimizer step -> checkpoint (model, optimizer,
    version v+1, checksum) -> ps.push(v+1) -> publish(v, fence, size, checksum, location)
    -> ps.commit(v+1, checksum)

The model is the tiny transformer or any Hugging Face causal LM (workers.models.hf): the
loss only needs next-token logits, and the PS moves whatever state dict the model has.

Fencing: a publish refused with 409 (another trainer's consume took the buffer, or another
trainer published it) stops this trainer with "fenced: ..." (TrainerError; the CLI exits 1):
its weights are not the published ones. Pushes stay provisional on the PS until the
publishing trainer commits their checksum; a fenced trainer's push of a committed version is
refused, and one that lands before the commit is replaced (the commit pushes again).
Rollout instances get only committed weights (a plain pull is served from the latest
committed version), so the trainer commits version 0 right after pushing it at start-up.

Exactly-once across crashes: the checkpoint is written atomically (temp file, fsync,
rename, fsync the directory) BEFORE the push and the publish, so on restart the
checkpoint's version k and the run's version r tell what happened:
  * k == r + 1: buffer r was trained but not published. Push v k again if the PS lacks it
    (same weights, so a duplicate push is a no-op), consume r again for a fresh fence (the
    buffer stays ready until published), publish. Nothing is trained twice.
  * k == r: continue at r. Nothing is skipped.
  * anything else: refuse (wrong directory, or another trainer moved the run).
Pushing before the checkpoint would be wrong: a crash between the two would leave the PS
holding v+1 while a restarted trainer retrains buffer v into *different* weights.

`steps.jsonl` beside the checkpoint logs one line per trained and per published version
(audit trail; tests check no version is trained twice); a trained line carries the step's loss
and metrics. Every checkpoint also records how its next step trains (`train`: the GRPO
settings, lr, batch use), and with `save_every` N the checkpoint of every N-th version is kept
as `versions/vK.pt`: the weights and optimizer state step K started from, which is what
`staleflow replay` needs to recompute step K's loss (workers/trainer/replay.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.client import StaleFlowClient
from workers.trainer.grpo import GRPOConfig, grpo_update
from workers.trainer.loop import (
    StepMetrics,
    TrainerError,
    batch_metrics,
    check_start,
    consume_ready,
    publish_fenced,
    record_step,
    run_steps,
)
from workers.trainer.param_client import ParamClient
from workers.trainer.param_store import ParamServerError, cast_dtype, state_dict_checksum
from workers.wire.models import BatchOut

log = logging.getLogger("staleflow.trainer")

CHECKPOINT = "trainer.pt"
STEPS_LOG = "steps.jsonl"
VERSIONS = "versions"  # kept checkpoints, one per saved version (save_every)
# Test hook: after checkpointing model version N, create `paused-vN` in the checkpoint
# directory and hang (before push and publish), so a test can SIGKILL us right there.
PAUSE_ENV = "STALEFLOW_TEST_PAUSE_AFTER_CHECKPOINT"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path, tmp = directory / CHECKPOINT, directory / f"{CHECKPOINT}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)
    return path


def version_checkpoint(directory: Path, version: int) -> Path:
    """Where `save_every` keeps the checkpoint of model version `version`."""
    return Path(directory) / VERSIONS / f"v{version}.pt"


def _keep(path: Path, kept: Path) -> None:
    """`kept` becomes a copy of the checkpoint just written: a hard link where the file system
    has them (the next checkpoint replaces trainer.pt by rename, so the link keeps this one)."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.unlink(missing_ok=True)
    try:
        os.link(path, kept)
    except OSError:
        shutil.copyfile(path, kept)
    _fsync_dir(kept.parent)


def load_checkpoint(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / CHECKPOINT
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def read_steps_log(directory: Path) -> list[dict[str, Any]]:
    path = Path(directory) / STEPS_LOG
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Trainer:
    def __init__(
        self,
        client: StaleFlowClient,
        run_id: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        ps: ParamClient | None = None,
        checkpoint_dir: str | os.PathLike,
        grpo: GRPOConfig = GRPOConfig(),
        wait_s: float = 5.0,
        micro_batch_tokens: int = 16384,
        max_grad_norm: float | None = 1.0,
        extra_state: dict[str, Any] | None = None,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        lr_scale: Callable[[int], float] | None = None,
        push_dtype: torch.dtype | None = None,
        save_every: int = 0,
    ):
        """`push_dtype`: what the weights travel to the PS as (floating tensors; never wider
        than the parameters; None: their own dtype), e.g. bfloat16 beside fp32 training.
        `save_every` N > 0 keeps the checkpoint of every N-th version (`versions/vK.pt`)."""
        self.client, self.run_id, self.model, self.optimizer = client, run_id, model, optimizer
        self.ps, self.dir = ps, Path(checkpoint_dir)
        self.grpo, self.wait_s = grpo, wait_s
        self.micro_batch_tokens, self.max_grad_norm = micro_batch_tokens, max_grad_norm
        self.ppo_epochs, self.minibatches = ppo_epochs, minibatches
        # lr of version v = base lr x lr_scale(v); the base is read before a resume can
        # load an optimizer state that holds a scaled lr
        self.lr_scale = lr_scale
        self.push_dtype = push_dtype
        self.save_every = save_every
        self._base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.extra_state = extra_state or {}  # e.g. the model config, kept in the checkpoint
        self.model.requires_grad_(True)
        self.version: int | None = None  # the run version we train next (after resume())
        self._stop = threading.Event()
        self._weights: dict[str, Any] = {}  # size/checksum of the checkpointed version

    def stop(self) -> None:
        """Finish the current step (train, checkpoint, push, publish), then return."""
        self._stop.set()

    # ---- start-up --------------------------------------------------------------------------

    def resume(self) -> StepMetrics | None:
        """Reconcile the checkpoint with the run; publishes a trained-but-unpublished step
        (returning its metrics) or returns None."""
        r = self.client.run_status(self.run_id).version
        ck = load_checkpoint(self.dir)
        if ck is None:
            check_start(
                self.run_id,
                r,
                False,
                f"{self.dir} holds no trainer checkpoint",
                "point --checkpoint-dir at this run's trainer checkpoint",
            )
            self._checkpoint(0)  # before the push of v0, as for every version
            k = 0
        else:
            if ck.get("run_id") != self.run_id:
                raise TrainerError(f"{self.dir / CHECKPOINT} belongs to run {ck.get('run_id')}, not {self.run_id}")
            if ck.get("offline"):
                raise TrainerError(
                    f"{self.dir / CHECKPOINT} was trained offline from {ck['offline']}: its versions were never "
                    "published; give this trainer another --checkpoint-dir"
                )
            self.model.load_state_dict(ck["model"])
            self.optimizer.load_state_dict(ck["optimizer"])
            self._weights = {"size": ck["size_bytes"], "checksum": ck["checksum"]}
            k = int(ck["version"])
            if k not in (r, r + 1):
                raise TrainerError(
                    f"checkpoint in {self.dir} is at model version {k} but run {self.run_id} is at "
                    f"version {r} (expected {r} or {r + 1}): another trainer moved the run, or the "
                    "checkpoint is from elsewhere"
                )
        self._ensure_pushed(k)
        self.version = r
        if k == r:
            if k > 0:
                self._check_published(k)
            # a crash may have come between publish and commit; version 0 (the initial
            # weights, published by creating the run) is committed right after its push
            self._commit_pushed(k)
        if k == r:
            log.info("run %s at version %s: starting there", self.run_id, r)
            return None
        log.info("checkpoint has version %s trained but not published: publishing it", k)
        batch, waited = consume_ready(self.client, self.run_id, r, self.wait_s, self._stop.is_set)
        if batch is None:
            return None
        m = batch_metrics(batch)
        m.wait_s, m.resumed, m.checksum = waited, True, self._weights["checksum"]
        self._publish(batch, m)
        return m

    def _check_published(self, k: int) -> None:
        """Version k is published: it must be with our checksum, else we are a fenced trainer."""
        published = {p.version: p.checksum for p in self.client.param_versions(self.run_id)}
        theirs = published.get(k)
        if theirs is not None and theirs != self._weights["checksum"]:
            raise TrainerError(f"fenced: another trainer published version {k} (checksum {theirs[:12]})")

    def _ensure_pushed(self, k: int) -> None:
        """The PS must serve the checkpoint's version k (a crash may have come before the push)."""
        if self.ps is None:
            return
        latest = self.ps.latest()
        if latest is not None and latest["version"] > k:
            raise TrainerError(
                f"the PS at {self.ps.addr} serves version {latest['version']}, newer than this "
                f"trainer's checkpoint ({k}): it belongs to another run or checkpoint"
            )
        if latest is not None and latest["version"] == k:
            if latest["checksum"] == self._weights["checksum"]:
                return
            if latest.get("committed"):
                raise TrainerError(
                    f"fenced: another trainer published version {k} (the PS serves checksum "
                    f"{latest['checksum'][:12]}, this trainer has {self._weights['checksum'][:12]})"
                )
            # provisional weights of another trainer under k: ours replace them; the publish
            # (fenced by the consume fence) decides which trainer's weights are final
        self._push(k)

    def _commit_pushed(self, k: int) -> None:
        """After publishing k: pin the PS's k to our (published) checksum. A fenced trainer
        may have pushed other weights under k meanwhile: push ours again, then commit."""
        if self.ps is None:
            return
        for _ in range(3):
            try:
                self.ps.commit(k, self._weights["checksum"])
                return
            except ParamServerError as e:
                log.warning("commit of v%s refused (%s): pushing it again", k, e)
                self._push(k)
        raise TrainerError(f"the PS at {self.ps.addr} keeps serving other weights as published version {k}")

    # ---- the loop --------------------------------------------------------------------------

    def run(self, steps: int | None = None, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Resume, then train until stopped or `steps` versions were published (a resumed
        publish counts)."""
        done: list[StepMetrics] = []
        first = self.resume()
        if first is not None:
            record_step(first, done, on_step)
        return run_steps(self.step, self._stop.is_set, steps, on_step, done)

    def step(self) -> StepMetrics | None:
        """One version: None if no batch became ready before a stop was requested."""
        if self.version is None:
            raise TrainerError("call resume() (or run()) first")
        v = self.version
        batch, waited = consume_ready(self.client, self.run_id, v, self.wait_s, self._stop.is_set)
        if batch is None:
            return None
        m = batch_metrics(batch)
        m.wait_s = waited
        self._train_version(batch, v, m)
        self._log_trained(batch, m)
        _maybe_pause(self.dir, v + 1)
        self._publish(batch, m)
        return m

    def _train_version(self, batch: BatchOut, v: int, m: StepMetrics) -> None:
        """Train model version `v` on the batch at the schedule's lr and checkpoint version v + 1,
        filling the step's loss, metrics, train time and checksum."""
        t0 = time.monotonic()
        if self.lr_scale is not None:
            for group, base in zip(self.optimizer.param_groups, self._base_lrs):
                group["lr"] = base * self.lr_scale(v)
        m.loss, m.extra = self.train_batch(batch)
        m.train_s = time.monotonic() - t0
        self._checkpoint(v + 1)
        m.checksum = self._weights["checksum"]

    def _log_trained(self, batch: BatchOut, m: StepMetrics, **more: Any) -> None:
        v = batch.version
        self._log(
            {
                "event": "trained",
                "buffer": v,
                "version": v + 1,
                "checksum": m.checksum,
                "groups": [g.group_id for g in batch.groups],
                "loss": m.loss,
                "metrics": m.extra,
                **more,
            }
        )

    def _reported(self, v: int, m: StepMetrics) -> dict[str, float] | None:
        """The step's loss and metrics, published with its version (an export carries them to
        `staleflow replay`); a resumed publish reports the ones its trained line logged. Only
        finite numbers travel: the others are named in a warning (they stay in steps.jsonl)."""
        if m.loss is not None:
            sent: dict[str, Any] = {"loss": m.loss, **m.extra}
        else:
            trained = [e for e in read_steps_log(self.dir) if e["event"] == "trained" and e["buffer"] == v]
            if not trained or trained[-1].get("loss") is None:
                return None
            sent = {"loss": trained[-1]["loss"], **trained[-1].get("metrics", {})}
        bad = sorted(k for k, x in sent.items() if not math.isfinite(x))
        if bad:
            log.warning("step %s: %s not finite: published without them", v, ", ".join(bad))
        return {k: float(x) for k, x in sent.items() if k not in bad}

    def _publish(self, batch: BatchOut, m: StepMetrics) -> None:
        v = batch.version
        t0 = time.monotonic()
        self._ensure_pushed(v + 1)
        m.push_s = time.monotonic() - t0
        t0 = time.monotonic()
        location = f"ps://{self.ps.addr[0]}:{self.ps.addr[1]}/v{v + 1}" if self.ps else None
        new = publish_fenced(
            self.client,
            self.run_id,
            v,
            batch.consume_fence,
            size_bytes=self._weights["size"],
            checksum=self._weights["checksum"],
            location=location,
            metrics=self._reported(v, m),
        )
        self._commit_pushed(v + 1)
        m.publish_s = time.monotonic() - t0
        self._log({"event": "published", "buffer": v, "version": new, "resumed": m.resumed})
        self.version = new

    # ---- training --------------------------------------------------------------------------

    def train_batch(self, batch: BatchOut) -> tuple[float, dict[str, float]]:
        """GRPO on the batch (`ppo_epochs` x `minibatches` optimizer steps); returns (loss, metrics)."""
        seqs, starts, rollout, groups, rewards, masks = [], [], [], [], [], []
        max_seq = _max_seq(self.model)
        for gi, g in enumerate(batch.groups):
            for s in g.samples:
                seq = list(g.prompt_tokens) + list(s.tokens)
                if max_seq is not None and len(seq) > max_seq:
                    raise TrainerError(f"sample {s.sample_id}: {len(seq)} tokens exceed the model's max_seq {max_seq}")
                if len(s.logprobs) != len(s.tokens):
                    raise TrainerError(f"sample {s.sample_id}: {len(s.tokens)} tokens but {len(s.logprobs)} log-probs")
                seqs.append(seq)
                starts.append(len(g.prompt_tokens))
                rollout.append(list(s.logprobs))
                masks.append(list(s.loss_mask))  # 0 on an environment's observations: not trained on
                groups.append(gi)
                rewards.append(s.reward)
        return grpo_update(
            self.model,
            self.optimizer,
            seqs,
            starts,
            rollout,
            groups,
            rewards,
            self.grpo,
            epochs=self.ppo_epochs,
            minibatches=self.minibatches,
            micro_batch_tokens=self.micro_batch_tokens,
            max_grad_norm=self.max_grad_norm,
            loss_masks=masks,
        )

    # ---- weights, checkpoint, log ------------------------------------------------------------

    def _state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def _checkpoint(self, version: int) -> None:
        sd = self._state_dict()  # checkpointed as trained; pushed (and checksummed) in push_dtype
        self._weights = {
            "size": sum(t.numel() * cast_dtype(t, self.push_dtype).itemsize for t in sd.values()),
            "checksum": state_dict_checksum(sd, self.push_dtype),
        }
        save_checkpoint(
            self.dir,
            {
                "run_id": self.run_id,
                "version": version,
                "model": sd,
                "optimizer": self.optimizer.state_dict(),
                "size_bytes": self._weights["size"],
                "checksum": self._weights["checksum"],
                "train": self.train_settings(version),
                **self.extra_state,
            },
        )
        if self.save_every and version % self.save_every == 0:
            _keep(self.dir / CHECKPOINT, version_checkpoint(self.dir, version))

    def train_settings(self, version: int) -> dict[str, Any]:
        """How the step from model `version` trains, beside the checkpoint of that version (the
        optimizer's own settings travel in its state dict): enough to train it again exactly."""
        scale = self.lr_scale(version) if self.lr_scale is not None else None
        return {
            "optimizer": type(self.optimizer).__name__,  # a torch.optim class
            "grpo": dataclasses.asdict(self.grpo),
            "ppo_epochs": self.ppo_epochs,
            "minibatches": self.minibatches,
            "micro_batch_tokens": self.micro_batch_tokens,
            "max_grad_norm": self.max_grad_norm,
            # None: the optimizer state's lr (no schedule moves it)
            "lrs": None if scale is None else [base * scale for base in self._base_lrs],
            "push_dtype": None if self.push_dtype is None else str(self.push_dtype).removeprefix("torch."),
            # CPU reductions sum in an order set by the thread count: the same count, the same bits
            "threads": torch.get_num_threads(),
        }

    def _push(self, version: int) -> None:
        assert self.ps is not None
        checksum = self.ps.push(self._state_dict(), version, dtype=self.push_dtype)
        if checksum != self._weights["checksum"]:
            raise TrainerError(
                f"PS reports checksum {checksum[:12]} for v{version}, expected {self._weights['checksum'][:12]}"
            )
        log.info("pushed v%s to the PS at %s:%s", version, *self.ps.addr)

    def _log(self, entry: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / STEPS_LOG, "a") as f:
            f.write(json.dumps({**entry, "pid": os.getpid(), "at": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _max_seq(model: nn.Module) -> int | None:
    tiny = getattr(model, "cfg", None)
    if tiny is not None:
        return int(tiny.max_seq)
    config = getattr(model, "config", None)
    if config is None:
        return None
    from workers.models.hf import max_positions

    return max_positions(config)


def _maybe_pause(directory: Path, version: int) -> None:
    if os.environ.get(PAUSE_ENV, "").strip() != str(version):
        return
    (directory / f"paused-v{version}").touch()
    log.warning("test hook: paused after checkpointing v%s (before push and publish)", version)
    while True:
        time.sleep(3600)
