"""The rows of a user's data set, read as a stream (constant memory, whatever its size).

Formats, told apart by the path (or named with ``fmt``):

- ``jsonl``: a JSON Lines file (``.jsonl``, ``.ndjson``, ``.json``), one JSON object a line;
  rows are named by line (blank lines are skipped).
- ``parquet``: a Parquet file (``.parquet``), read batch by batch; rows are named by number,
  counted from 1.
- ``saved``: a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a
  ``DatasetDict`` with one split chosen), memory-mapped and read in batches.
- ``folder``: a folder of data files as ``datasets.load_dataset(FOLDER)`` reads it (its split
  patterns: ``train.jsonl``, ``data/train-00000-of-00002.parquet``, ...); each file is read as
  above, so a row is named by its file and line or row.

Parquet and ``datasets`` need the ``data`` extra (pyarrow, datasets), imported only here and
only for those formats. A row that cannot be read (invalid JSON, not an object) comes out as
a `Row` with a ``problem`` instead of a record: the caller decides whether it stops the run.
`write_parquet` writes rows the other way (``staleflow dataset ... --out FILE.parquet``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.extras import require

FORMATS = ("jsonl", "parquet", "saved", "folder")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
BATCH = 1024  # rows per Parquet / Arrow batch: bounded memory, few Python round trips


class DataError(ValueError):
    """The data set as a whole cannot be read (unknown format, no such split, ...)."""


@dataclass(frozen=True)
class Row:
    file: str  # the file (or saved folder) the row is in, as the user named it
    unit: str  # "line" (JSON Lines) or "row" (columnar formats, counted from 1)
    number: int
    record: dict[str, Any] | None
    problem: str | None = None  # why the row could not be read (then record is None)

    @property
    def where(self) -> str:
        return f"{self.file}: {self.unit} {self.number}"


@dataclass(frozen=True)
class Source:
    """An opened data set: `rows()` streams it from the start, as often as called."""

    name: str
    format: str
    total: int  # rows (non-blank lines for JSON Lines), for progress
    columns: tuple[str, ...] | None  # every row's columns, when the format declares them
    rows: Callable[[], Iterator[Row]]


def open_data(path: Path, fmt: str | None = None, split: str | None = None) -> Source:
    """The data set at `path`; raises DataError (naming what to change) if it cannot be read."""
    if not path.exists():
        raise DataError(f"{path} does not exist")
    fmt = fmt or _guess(path)
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt in ("jsonl", "parquet") and not path.is_file():
        raise DataError(f"{path} is a folder, not a {fmt} file")
    if fmt in ("saved", "folder") and not path.is_dir():
        raise DataError(f"{path} is a file; the {fmt!r} format is a folder")
    if split is not None and fmt in ("jsonl", "parquet"):
        raise DataError(f"--split applies to datasets folders; {path} is one {fmt} file")
    if fmt == "jsonl":
        return _jsonl(path)
    if fmt == "parquet":
        return _parquet(path)
    if fmt == "saved":
        return _saved(path, split)
    return _folder(path, split)


def _guess(path: Path) -> str:
    if path.is_dir():
        saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        return "saved" if saved else "folder"
    if path.suffix.lower() in JSONL_SUFFIXES:
        return "jsonl"
    if path.suffix.lower() == ".parquet":
        return "parquet"
    raise DataError(
        f"cannot tell the format of {path} from its name (JSON Lines: {', '.join(JSONL_SUFFIXES)}; "
        "Parquet: .parquet; a datasets folder: a folder): pass --format jsonl or --format parquet"
    )


# ---- files ------------------------------------------------------------------------------


def _jsonl(path: Path) -> Source:
    with path.open("rb") as f:  # a quick pass for the progress total
        total = sum(1 for raw in f if raw.strip())
    return Source(str(path), "jsonl", total, None, lambda: _jsonl_rows(path, str(path)))


def _jsonl_rows(path: Path, name: str) -> Iterator[Row]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            # a whole-file JSON array (`[{...}, ...]`) is the usual mistake: say so on its first line
            hint = (
                " (a JSON array? write JSON Lines: one object a line)"
                if number == 1 and raw.lstrip()[:1] == b"["
                else ""
            )
            try:
                obj = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))  # a BOM may lead
            except UnicodeDecodeError as e:
                yield Row(name, "line", number, None, f"not UTF-8 text ({e.reason} at byte {e.start})")
                continue
            except json.JSONDecodeError as e:  # its own "line 1 column 5" would be within the line
                yield Row(name, "line", number, None, f"not valid JSON ({e.msg} at character {e.pos + 1}){hint}")
                continue
            if not isinstance(obj, dict):
                yield Row(name, "line", number, None, f"expected a JSON object, got {type(obj).__name__}{hint}")
                continue
            yield Row(name, "line", number, obj)


def _parquet_file(path: Path) -> Any:
    pq = require("pyarrow.parquet")
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends: not a Parquet file
        raise DataError(f"{path} is not a readable Parquet file: {e}") from None


def _parquet(path: Path) -> Source:
    meta = _parquet_file(path)
    columns = tuple(meta.schema_arrow.names)
    return Source(str(path), "parquet", meta.metadata.num_rows, columns, lambda: _parquet_rows(path, str(path)))


def _parquet_rows(path: Path, name: str) -> Iterator[Row]:
    number = 0
    for batch in _parquet_file(path).iter_batches(batch_size=BATCH):
        for record in batch.to_pylist():
            number += 1
            yield Row(name, "row", number, record)


def write_parquet(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Rows (dicts with the same columns) to a Parquet file, a row group per BATCH rows; the count."""
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    writer, count, batch = None, 0, []
    try:
        for row in rows:
            batch.append(row)
            if len(batch) == BATCH:
                writer, count, batch = _write(pa, pq, path, writer, batch), count + len(batch), []
        if batch or writer is None:
            writer, count = _write(pa, pq, path, writer, batch), count + len(batch)
    finally:
        if writer is not None:
            writer.close()
    return count


def _write(pa: Any, pq: Any, path: Path, writer: Any, batch: list[dict[str, Any]]) -> Any:
    table = pa.Table.from_pylist(batch)
    writer = writer or pq.ParquetWriter(path, table.schema)
    writer.write_table(table)
    return writer


# ---- datasets folders -------------------------------------------------------------------


def _choose(path: Path, splits: list[str], split: str | None) -> str:
    if split is None:
        if len(splits) == 1:
            return splits[0]
        raise DataError(f"{path} holds the splits {', '.join(splits)}: pass --split with one of them")
    if split not in splits:
        raise DataError(f"{path} has no split {split!r} (splits: {', '.join(splits)})")
    return split


def _saved(path: Path, split: str | None) -> Source:
    datasets = require("datasets")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:  # FileNotFoundError: not a save_to_disk folder
        raise DataError(f"{path} is not a folder written by save_to_disk: {e}") from None
    name = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        chosen = _choose(path, list(loaded), split)
        loaded, name = loaded[chosen], f"{path} [{chosen}]"
    elif split is not None:
        raise DataError(f"{path} is a single Dataset (no splits): drop --split")
    dataset = loaded.with_format(None)  # plain Python values, whatever format was saved with it

    def rows() -> Iterator[Row]:
        number = 0
        for batch in dataset.iter(batch_size=BATCH):
            for values in zip(*batch.values()):
                number += 1
                yield Row(name, "row", number, dict(zip(batch.keys(), values)))

    return Source(name, "saved", len(dataset), tuple(dataset.column_names), rows)


def _folder(path: Path, split: str | None) -> Source:
    """Which files make which split is `datasets`' own resolution (load_dataset_builder); the
    files are then read here, so each row is named by its file."""
    datasets = require("datasets")
    try:
        builder = datasets.load_dataset_builder(str(path))
    except Exception as e:  # datasets raises several kinds for a folder it cannot read
        raise DataError(f"datasets cannot read the folder {path}: {e}") from None
    kinds = {"json": "jsonl", "parquet": "parquet"}
    if builder.name not in kinds:
        raise DataError(
            f"{path} holds {builder.name} data files; enqueue reads JSON Lines and Parquet "
            "(convert the files, or save the data with Dataset.save_to_disk)"
        )
    data_files = {str(k): [Path(f) for f in v] for k, v in (builder.config.data_files or {}).items()}
    if not data_files:
        raise DataError(f"{path} holds no data files")
    chosen = _choose(path, list(data_files), split)
    files, kind = data_files[chosen], kinds[builder.name]
    parts = [_jsonl(f) if kind == "jsonl" else _parquet(f) for f in files]
    shared = [set(p.columns) for p in parts if p.columns is not None]
    columns = tuple(sorted(set.intersection(*shared))) if shared else None

    def rows() -> Iterator[Row]:
        for f in files:
            yield from _jsonl_rows(f, str(f)) if kind == "jsonl" else _parquet_rows(f, str(f))

    return Source(f"{path} [{chosen}]", "folder", sum(p.total for p in parts), columns, rows)
