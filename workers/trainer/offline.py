"""`staleflow trainer --offline EXPORT`: the same trainer (`Trainer.train_batch`, checkpoints,
steps log) trained on an export's batches in step order instead of consuming them from a run.
No API, no parameter server, no rollout: nothing is published, and its checkpoint is marked
offline so that a live trainer refuses to resume from it.

Model version k of an offline checkpoint means the export's steps before k are trained; a
restart with the same checkpoint directory continues with the next step."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workers.export_read import Export
from workers.trainer.loop import StepMetrics, TrainerError, batch_metrics
from workers.trainer.torch_trainer import CHECKPOINT, Trainer, load_checkpoint
from workers.wire.models import BatchOut

log = logging.getLogger("staleflow.trainer")


class OfflineTrainer(Trainer):
    def __init__(self, export: Export, *args: Any, extra_state: dict[str, Any] | None = None, **kwargs: Any):
        """`args`, `kwargs`: Trainer's after the client and run id (model, optimizer, ...)."""
        super().__init__(
            None,  # type: ignore[arg-type]  # no API: the batches come from the export
            export.run_id,
            *args,
            extra_state={**(extra_state or {}), "offline": str(export.dir.resolve())},
            **kwargs,
        )
        self.export = export
        self._batches: Iterator[BatchOut] | None = None

    def resume(self) -> StepMetrics | None:
        ck = load_checkpoint(self.dir)
        if ck is None:
            self._checkpoint(0)
            self.version = 0
        else:
            if not ck.get("offline"):
                raise TrainerError(
                    f"{self.dir / CHECKPOINT} is a live trainer's checkpoint of run {ck.get('run_id')}: "
                    "train offline into another --checkpoint-dir"
                )
            if ck.get("run_id") != self.run_id:
                raise TrainerError(
                    f"{self.dir / CHECKPOINT} was trained on run {ck.get('run_id')}'s export, not run {self.run_id}'s"
                )
            self.model.load_state_dict(ck["model"])
            self.optimizer.load_state_dict(ck["optimizer"])
            self._weights = {"size": ck["size_bytes"], "checksum": ck["checksum"]}
            self.version = int(ck["version"])
            log.info("offline checkpoint at version %s: continuing with step %s", self.version, self.version)
        self._batches = (b for b in self.export.batches() if b.version >= (self.version or 0))
        return None

    def step(self) -> StepMetrics | None:
        """Train the export's next step; None (and stop) once every step is trained."""
        if self._batches is None or self.version is None:
            raise TrainerError("call resume() (or run()) first")
        batch = next(self._batches, None)
        if batch is None:
            self.stop()
            return None
        v = batch.version
        m = batch_metrics(batch)
        self._train_version(batch, v, m)
        self._log_trained(batch, m, offline=True)
        self.version = v + 1
        return m


def offline_directory(home: Path, run_id: int) -> Path:
    """Where an offline trainer checkpoints by default: beside, never in, the live trainer's."""
    return home / "trainer" / f"offline-run-{run_id}"
