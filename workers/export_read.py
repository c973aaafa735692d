"""Read an export folder (written by workers/export.py) back as the batches the trainer consumed:
`staleflow replay` rebuilds one step's, `staleflow trainer --offline` trains on all of them in
step order. Torch-free; no database, no API.

A step's batch is rebuilt as the consume endpoint hands it out (staleflow_db/sql/training.sql:
consume_groups, consume_samples): its groups in group id order, each group's rewarded samples
in index order, each sample's tokens, log-probs and loss mask in segment order."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workers.export import MANIFEST, RUN, STEPS
from workers.extras import require
from workers.wire.models import BatchOut, SegmentInfoOut, TrainGroupOut, TrainSampleOut

# what a batch is rebuilt from (the rest of a row is description)
COLUMNS = [
    "sample_id",
    "group_id",
    "idx",
    "prompt_tokens",
    "step",
    "v_traj",
    "reward",
    "finish_reason",
    "response_tokens",
    "logprobs",
    "loss_mask",
    "seg_lengths",
    "seg_versions",
    "seg_instances",
]


class ExportError(ValueError):
    """The folder is not an export this can read, or lacks what was asked for; says which."""


class Export:
    def __init__(self, folder: str | Path):
        self.dir = Path(folder)
        manifest, run = self.dir / MANIFEST, self.dir / RUN
        if not manifest.is_file() or not run.is_file():
            raise ExportError(f"{self.dir} is not an export (no {MANIFEST} and {RUN}): write one with staleflow export")
        self.manifest: dict[str, Any] = json.loads(manifest.read_text())
        self.run: dict[str, Any] = json.loads(run.read_text())
        self.files = [self.dir / f for f in self.manifest.get("files") or []]

    @property
    def run_id(self) -> int:
        """The run exported (run.json holds the database's run or the API's run status)."""
        return int(self.run["id"] if "id" in self.run else self.run["run_id"])

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.run.get("config") or {})

    def published(self, step: int) -> dict[str, Any] | None:
        """The version step `step` published (steps.jsonl: its checksum and `train_metrics`,
        what the trainer reported of the step); None if the export has no record of it."""
        path = self.dir / STEPS
        if not path.is_file():
            return None
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip() and (rec := json.loads(line))["step"] == step:
                    return rec
        return None

    def _rows(self, step: int | None = None) -> Iterator[dict[str, Any]]:
        """Every trained row (a step), or those of `step`, file by file."""
        for path in self.files:
            if self.manifest["format"] == "parquet":
                pq = require("pyarrow.parquet")
                filters = [("step", "=", step)] if step is not None else [("step", ">=", 0)]
                yield from pq.read_table(path, columns=COLUMNS, filters=filters).to_pylist()
                continue
            with path.open(encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    if row.get("step") is not None and (step is None or row["step"] == step):
                        yield row

    def steps(self) -> list[int]:
        """The trained steps the export holds, in order."""
        return sorted({int(r["step"]) for r in self._rows()})

    def batch(self, step: int) -> BatchOut:
        """The batch step `step` trained on; ExportError if the export lacks it (or holds a
        part of it: an export still being written)."""
        rows = list(self._rows(step))
        if not rows:
            have = self.steps()
            held = f"steps {have[0]}..{have[-1]}" if have else "no trained step"
            kind = "" if self.manifest.get("trained") else " (an --all export holds the trained ones too)"
            raise ExportError(f"{self.dir} holds {held}, not step {step}{kind}")
        return self._build(step, rows)

    def batches(self) -> Iterator[BatchOut]:
        """Every trained step's batch in step order (one pass over the files, then grouped)."""
        by_step: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in self._rows():
            by_step[int(r["step"])].append(r)
        for step in sorted(by_step):
            yield self._build(step, by_step.pop(step))

    def _build(self, step: int, rows: list[dict[str, Any]]) -> BatchOut:
        groups: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            groups[int(r["group_id"])].append(r)
        want = self.config.get("batch_size")
        if want is not None and len(groups) != want:
            raise ExportError(
                f"{self.dir} holds {len(groups)} group(s) of step {step}, the run trains {want} per step: "
                "an incomplete export (run staleflow export again to finish it)"
            )
        return BatchOut(
            run_id=self.run_id,
            version=step,
            consume_fence=0,  # not consumed: nothing is published from a rebuilt batch
            groups=[_group(gid, sorted(groups[gid], key=lambda r: r["idx"])) for gid in sorted(groups)],
        )


def _group(gid: int, rows: list[dict[str, Any]]) -> TrainGroupOut:
    return TrainGroupOut(
        group_id=gid,
        # the export has no group version; training does not read it: the oldest sample's
        group_version=min(int(r["v_traj"]) for r in rows),
        prompt_tokens=list(rows[0]["prompt_tokens"]),
        meta={},
        samples=[_sample(r) for r in rows],
    )


def _sample(r: dict[str, Any]) -> TrainSampleOut:
    segments = [
        SegmentInfoOut(seq=i, version=v, instance_id=inst, n_tokens=n, generated=v is not None)
        for i, (n, v, inst) in enumerate(zip(r["seg_lengths"], r["seg_versions"], r["seg_instances"]))
    ]
    return TrainSampleOut(
        sample_id=r["sample_id"],
        idx=r["idx"],
        v_traj=r["v_traj"],
        tokens=list(r["response_tokens"]),
        logprobs=list(r["logprobs"]),
        reward=r["reward"],
        finish_reason=r["finish_reason"],
        segments=segments,
        loss_mask=[int(m) for m in r["loss_mask"]],
    )
