"""Parameter store: how a state dict is laid out, checksummed and persisted by the PS
(workers.trainer.param_server, which re-exports every public name here).

  * Layout: a state dict travels as ONE flat uint8 buffer -- tensors in canonical order
    (element size descending, then name, so every tensor is naturally aligned and can be
    viewed in place). The same bytes are the data section of the safetensors file the PS
    persists, so nothing is re-packed between disk, memory and wire.
  * Buckets: a pull may stream in buckets -- runs of whole tensors in canonical order, each
    at most a bucket size unless one tensor alone is larger (it then travels alone) -- so a
    puller holds one bucket at a time (`buckets`, used by both ends of a transfer).
  * Dtype: `flatten(..., dtype=)` casts floating tensors as it packs them (the trainer pushes
    in its push dtype, never wider than the parameters), with no intermediate copy.
  * Integrity: checksum = sha256(canonical header JSON + flat bytes), i.e. over every
    tensor's name, dtype, shape and bytes in canonical order. ChecksumError on a mismatch.
  * On disk: `<dir>/v{version}.safetensors` plus `<dir>/v{version}.json` (version, size,
    checksum, file), the JSON written last so its presence means the file is complete.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
# bytes per send/recv message: small enough that hashing (and on the PS writing) chunk k
# overlaps the transfer of chunk k+1, large enough that per-message overhead is noise
_CHUNK = 16 << 20
_FLUSH_EVERY = 128 << 20  # bytes written between background fdatasync calls on the PS
# what a puller holds at a time by default: ~3% of a 7B bf16 model, and large enough that a
# bucket's many chunk messages keep the link busy
DEFAULT_BUCKET_BYTES = 256 << 20


class ParamServerError(RuntimeError):
    """The PS refused a request (unknown version, stale push, ...)."""


class ChecksumError(ParamServerError):
    """Weights whose checksum does not match the published one."""


# ---- canonical layout -------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> list[TensorMeta]:
    """Canonical order and offsets for {name: (dtype, shape)}."""
    order = sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))
    metas, off = [], 0
    for n in order:
        dt, shape = specs[n]
        if dt not in _DTYPES:
            raise TypeError(f"{n}: unsupported dtype {dt}")
        size = dt.itemsize * math.prod(shape)
        metas.append(TensorMeta(n, _DTYPES[dt], tuple(int(d) for d in shape), off, size))
        off += size
    return metas


@dataclass(frozen=True)
class Bucket:
    """Bytes [start, end) of the flat buffer: the whole tensors `metas`."""

    start: int
    end: int
    metas: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def buckets(metas: list[TensorMeta], bucket_bytes: int | None) -> list[Bucket]:
    """Cut the canonical layout into buckets of consecutive whole tensors, each at most
    `bucket_bytes` unless one tensor alone is larger (it is then a bucket of its own);
    None: one bucket of everything. Whole tensors, so every loader (vLLM's included) gets
    complete tensors; a model's largest tensor (the embedding) is a few % of it."""
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
        raise ValueError(f"bucket_bytes must be a positive integer, not {bucket_bytes!r}")
    out: list[Bucket] = []
    cur: list[TensorMeta] = []
    start = 0
    for m in metas:
        if cur and bucket_bytes is not None and m.offset + m.nbytes - start > bucket_bytes:
            out.append(Bucket(start, m.offset, tuple(cur)))
            cur, start = [], m.offset
        cur.append(m)
    if cur:
        out.append(Bucket(start, cur[-1].offset + cur[-1].nbytes, tuple(cur)))
    return out


def tensors_of(received: Iterable[tuple[Bucket, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) of every tensor of each (bucket, its bytes), in order: no copy."""
    for b, data in received:
        for m in b.metas:
            yield m.name, data[m.offset - b.start : m.offset - b.start + m.nbytes].view(_BY_NAME[m.dtype]).view(m.shape)


def _metas_json(metas: list[TensorMeta]) -> list:
    return [[m.name, m.dtype, list(m.shape)] for m in metas]


def _metas_from_json(raw: list) -> list[TensorMeta]:
    return layout({n: (_BY_NAME[d], tuple(s)) for n, d, s in raw})


def _header(metas: list[TensorMeta]) -> bytes:
    return json.dumps(_metas_json(metas), separators=(",", ":")).encode()


def cast_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """What `t` travels as: `dtype` for floating tensors unless that is wider than their own
    (never upcast: it would only double the bytes), their own otherwise or if None."""
    if dtype is None or not t.is_floating_point() or dtype.itemsize > t.dtype.itemsize:
        return t.dtype
    return dtype


def flatten(
    state_dict: Mapping[str, torch.Tensor], device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """The flat buffer of `state_dict`, floating tensors cast to `dtype` (None: kept) while
    they are copied in: no second copy of the state dict in either dtype."""
    metas = layout({n: (cast_dtype(t, dtype), tuple(t.shape)) for n, t in state_dict.items()})
    flat = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device=device)
    for m in metas:
        if m.nbytes:
            # canonical offsets are aligned to the element size, so the bytes view as it
            flat[m.offset : m.offset + m.nbytes].view(_BY_NAME[m.dtype]).copy_(state_dict[m.name].detach().reshape(-1))
    return flat, metas


def unflatten(flat: torch.Tensor, metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
    """Views into `flat` (no copy): the returned tensors share its memory."""
    return {m.name: flat[m.offset : m.offset + m.nbytes].view(_BY_NAME[m.dtype]).view(m.shape) for m in metas}


def _bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU uint8 tensor (numpy is not required)."""
    assert t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


def _hasher(metas: list[TensorMeta]):
    """sha256 primed with the canonical header; feed it the flat bytes in order."""
    return hashlib.sha256(_header(metas))


def _update(h, chunk: torch.Tensor) -> None:
    h.update(_bytes(chunk.cpu()))  # hashlib drops the GIL on big updates


def flat_checksum(flat: torch.Tensor, metas: list[TensorMeta]) -> str:
    h = _hasher(metas)
    for i in range(0, flat.numel(), _CHUNK):
        _update(h, flat[i : i + _CHUNK])
    return h.hexdigest()


def state_dict_checksum(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """The checksum the PS publishes for this state dict (pushed in `dtype`, see flatten)."""
    return flat_checksum(*flatten(state_dict, dtype=dtype))


# ---- persistence (safetensors format, written and read without copies) --------------------
class VersionWriter:
    """Streams one version to `<dir>/v{version}.safetensors` as its bytes arrive; nothing
    is visible until commit() (fsync, rename, then the JSON sidecar, written last)."""

    def __init__(self, data_dir: Path, version: int, metas: list[TensorMeta]):
        self.data_dir, self.version = data_dir, version
        self.path = data_dir / f"v{version}.safetensors"
        self.size = sum(m.nbytes for m in metas)
        hdr = {
            m.name: {"dtype": m.dtype, "shape": list(m.shape), "data_offsets": [m.offset, m.offset + m.nbytes]}
            for m in metas
        }
        hdr["__metadata__"] = {"version": str(version)}
        raw = json.dumps(hdr, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
        self._tmp = self.path.with_suffix(".tmp")
        self._f = open(self._tmp, "wb")  # buffered: writes are complete, never partial
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._unsynced = 0
        self._flusher: threading.Thread | None = None

    def write(self, chunk: torch.Tensor) -> None:
        self._f.write(_bytes(chunk.cpu()))
        # Flush to disk in the background while the transfer goes on: otherwise the page
        # cache absorbs a whole version and commit()'s fsync pays the full disk time.
        self._unsynced += chunk.numel()
        if self._unsynced >= _FLUSH_EVERY and not (self._flusher and self._flusher.is_alive()):
            self._unsynced = 0
            self._flusher = threading.Thread(target=os.fdatasync, args=(self._f.fileno(),), daemon=True)
            self._flusher.start()

    def _join_flusher(self) -> None:
        if self._flusher is not None:
            self._flusher.join()

    def commit(self, checksum: str) -> Path:
        self._join_flusher()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)
        side = {"version": self.version, "size": self.size, "checksum": checksum, "file": self.path.name}
        tmp_json = self.data_dir / f"v{self.version}.json.tmp"
        with open(tmp_json, "w") as f:
            f.write(json.dumps(side))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_json, self.data_dir / f"v{self.version}.json")
        dir_fd = os.open(self.data_dir, os.O_RDONLY)  # make both renames durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return self.path

    def abort(self) -> None:
        self._join_flusher()
        self._f.close()
        self._tmp.unlink(missing_ok=True)


def load_version(path: Path, expected_checksum: str | None = None) -> tuple[torch.Tensor, list[TensorMeta], str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
        hdr.pop("__metadata__", None)
        metas = layout({k: (_BY_NAME[v["dtype"]], tuple(v["shape"])) for k, v in hdr.items()})
        if any(hdr[m.name]["data_offsets"] != [m.offset, m.offset + m.nbytes] for m in metas):
            raise ParamServerError(f"{path}: not in the PS's canonical layout")
        flat = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8)
        if f.readinto(_bytes(flat)) != flat.numel():
            raise ChecksumError(f"{path}: truncated")
    checksum = flat_checksum(flat, metas)
    if expected_checksum is not None and checksum != expected_checksum:
        raise ChecksumError(f"{path}: checksum {checksum[:12]} != recorded {expected_checksum[:12]}")
    return flat, metas, checksum
