"""Write a run's rollouts to a folder (`staleflow export`): one file per chunk of samples, in
sample id order, Parquet (row groups of one page each, through pyarrow's ParquetWriter) or
JSON lines, plus `run.json` (the run and its configuration), `steps.jsonl` (each published
version: the step that trained it, its checksum and what the trainer reported of the step, its
loss among them) and `manifest.json` (the files written and the last sample id in them).

Constant memory: one page of samples is held at a time. Resumable: a chunk is written under a
temporary name and renamed, then the manifest (also renamed into place) records it, so an
interrupted export leaves only whole, recorded files; running it again continues after the
last recorded sample and writes the same files an uninterrupted run would (chunk boundaries
depend only on the sample ids)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from workers.extras import require

# (after, limit) -> rows with sample_id > after, in id order, at most limit (dicts: ExportRow's fields)
PageSource = Callable[[int, int], list[dict[str, Any]]]

MANIFEST = "manifest.json"
RUN = "run.json"
STEPS = "steps.jsonl"
FORMATS = ("parquet", "jsonl")


def _schema() -> Any:
    pa = require("pyarrow")
    ts = pa.timestamp("us", tz="UTC")
    i64, i32 = pa.int64(), pa.int32()
    return pa.schema(
        [
            ("sample_id", i64),
            ("group_id", i64),
            ("idx", i32),
            ("client_key", pa.string()),
            ("prompt_tokens", pa.list_(i32)),
            ("state", pa.string()),
            ("reason", pa.string()),
            ("group_state", pa.string()),
            ("step", i32),
            ("v_traj", i32),
            ("staleness", i32),
            ("reward", pa.float64()),
            ("reward_metrics", pa.string()),  # JSON text: each sample's metric names may differ
            ("reward_token_id", i64),
            ("finish_reason", pa.string()),
            ("n_tokens", i32),
            ("response_tokens", pa.list_(i32)),
            ("logprobs", pa.list_(pa.float32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("token_versions", pa.list_(i32)),
            ("seg_lengths", pa.list_(i32)),
            ("seg_versions", pa.list_(i32)),
            ("seg_instances", pa.list_(i64)),
            ("enqueued_at", ts),
            ("first_segment_at", ts),
            ("last_segment_at", ts),
            ("group_finished_at", ts),
            ("updated_at", ts),
        ]
    )


def _record(row: dict[str, Any]) -> dict[str, Any]:
    """A row as written: reward metrics as JSON text (keys sorted, so files are reproducible)."""
    metrics = row.get("reward_metrics")
    return {**row, "reward_metrics": None if metrics is None else json.dumps(metrics, sort_keys=True)}


def _step(version: dict[str, Any]) -> dict[str, Any]:
    """A published version as the step that trained it (version v: step v - 1)."""
    return {"step": version["version"] - 1, **version}


def _jsonable(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


@dataclass
class Manifest:
    format: str
    trained: bool
    after: int = 0  # the last sample id in the files written
    rows: int = 0
    files: list[str] | None = None

    @classmethod
    def load(cls, out: Path, fmt: str, trained: bool) -> Manifest:
        path = out / MANIFEST
        if not path.exists():
            return cls(fmt, trained, files=[])
        m = cls(**json.loads(path.read_text()))
        if (m.format, m.trained) != (fmt, trained):
            raise ValueError(
                f"{out} holds an export as {m.format} ({'trained' if m.trained else 'all'} samples); "
                "use another folder, or the same options to continue it"
            )
        return m

    def save(self, out: Path) -> None:
        _replace(out / MANIFEST, json.dumps(self.__dict__, indent=2).encode())


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _pages(source: PageSource, after: int, page: int, chunk: int) -> Iterator[list[dict[str, Any]]]:
    """The pages of one chunk (at most `chunk` rows), starting after `after`."""
    left = chunk
    while left > 0:
        want = min(page, left)
        rows = source(after, want)
        if not rows:
            return
        yield rows
        after, left = rows[-1]["sample_id"], left - len(rows)
        if len(rows) < want:
            return


def export(
    source: PageSource,
    out: Path,
    run: dict[str, Any],
    *,
    fmt: str = "parquet",
    trained: bool = False,
    page: int = 500,
    chunk: int = 10_000,
    progress: Callable[[int], None] = lambda n: None,
    versions: list[dict[str, Any]] | None = None,
) -> Manifest:
    """Write (or continue writing) the export into `out`; `progress(n)` after each page of n
    rows; `versions`: the run's published versions (ParamVersion's fields), for steps.jsonl.
    Returns the final manifest."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(out, fmt, trained)
    for left in out.glob("*.tmp"):  # an interrupted run's unrecorded chunk
        left.unlink()
    _replace(out / RUN, json.dumps(run, indent=2, default=_jsonable).encode())
    if versions is not None:
        _replace(out / STEPS, "".join(json.dumps(_step(v), default=_jsonable) + "\n" for v in versions).encode())
    files = manifest.files if manifest.files is not None else []
    manifest.files = files
    while True:
        name = f"part-{len(files):05d}.{fmt}"
        tmp = out / (name + ".tmp")
        n, last = _write_chunk(_pages(source, manifest.after, page, chunk), tmp, fmt, progress)
        if n == 0:
            tmp.unlink(missing_ok=True)
            break
        os.replace(tmp, out / name)
        files.append(name)
        manifest.after, manifest.rows = last, manifest.rows + n
        manifest.save(out)
        if n < chunk:
            break
    manifest.save(out)
    return manifest


def _write_chunk(
    pages: Iterator[list[dict[str, Any]]], path: Path, fmt: str, progress: Callable[[int], None]
) -> tuple[int, int]:
    """Write the pages to `path`; the number of rows and the last sample id."""
    n, last = 0, 0
    if fmt == "jsonl":
        with path.open("w", encoding="utf-8") as f:
            for rows in pages:
                for row in rows:
                    f.write(json.dumps(_record(row), default=_jsonable) + "\n")
                n, last = n + len(rows), rows[-1]["sample_id"]
                progress(len(rows))
        return n, last
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    schema = _schema()
    writer = None
    try:
        for rows in pages:
            if writer is None:
                writer = pq.ParquetWriter(path, schema)
            writer.write_table(pa.Table.from_pylist([_record(r) for r in rows], schema=schema))  # one row group
            n, last = n + len(rows), rows[-1]["sample_id"]
            progress(len(rows))
    finally:
        if writer is not None:
            writer.close()
    return n, last
