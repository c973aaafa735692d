"""Parameter server (PS): the trainer pushes weight versions, rollout instances pull them.

Design
  * Control: a small TCP server speaking JSON lines -- `latest`, `pull`, `push`. One
    connection per request; it stays open for the duration of that transfer.
  * Data: `torch.distributed` point-to-point. Each transfer gets its own two-rank group
    (PS rank 0, peer rank 1) rendezvousing through a TCPStore the PS opens on a free port.
    Groups are built directly as ProcessGroupGloo/ProcessGroupNCCL objects rather than
    via `init_process_group`, whose single default group per process would forbid
    concurrent transfers and peers that come and go (vLLM's weight sync does the same).
  * Layout: a state dict travels as ONE flat uint8 buffer -- tensors in canonical order
    (element size descending, then name, so every tensor is naturally aligned and can be
    viewed in place). The same bytes are the data section of the safetensors file the PS
    persists, so nothing is re-packed between disk, memory and wire.
  * Integrity: checksum = sha256(canonical header JSON + flat bytes), i.e. over every
    tensor's name, dtype, shape and bytes in canonical order. The PS checks pushes against
    the trainer's checksum, pullers check what they received, a restarted PS checks the
    file on disk, and each raises ChecksumError on a mismatch.
  * Versions: the PS keeps the latest in memory, and an older one only while pulls of it
    are in flight. On disk it keeps the latest only: `<dir>/v{version}.safetensors` plus
    `<dir>/v{version}.json` (version, size, checksum, file), the JSON written last so its
    presence means the file is complete.
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import json
import logging
import math
import os
import signal
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

log = logging.getLogger("staleflow.ps")

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
# bytes per send/recv message: small enough that hashing (and on the PS writing) chunk k
# overlaps the transfer of chunk k+1, large enough that per-message overhead is noise
_CHUNK = 16 << 20
_FLUSH_EVERY = 128 << 20  # bytes written between background fdatasync calls on the PS

# on_published(version, size_bytes, checksum, location): called once a version is on disk
# and served, again on a retried push of it, and at start-up for the version loaded from
# disk -- so it must be idempotent (e.g. an upsert of the version's row).
OnPublished = Callable[[int, int, str, str], None]


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


def _metas_json(metas: list[TensorMeta]) -> list:
    return [[m.name, m.dtype, list(m.shape)] for m in metas]


def _metas_from_json(raw: list) -> list[TensorMeta]:
    return layout({n: (_BY_NAME[d], tuple(s)) for n, d, s in raw})


def _header(metas: list[TensorMeta]) -> bytes:
    return json.dumps(_metas_json(metas), separators=(",", ":")).encode()


def flatten(state_dict: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
            ) -> tuple[torch.Tensor, list[TensorMeta]]:
    metas = layout({n: (t.dtype, tuple(t.shape)) for n, t in state_dict.items()})
    flat = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device=device)
    for m in metas:
        if m.nbytes:
            src = state_dict[m.name].detach().contiguous().reshape(-1).view(torch.uint8)
            flat[m.offset:m.offset + m.nbytes].copy_(src)
    return flat, metas


def unflatten(flat: torch.Tensor, metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
    """Views into `flat` (no copy): the returned tensors share its memory."""
    return {m.name: flat[m.offset:m.offset + m.nbytes].view(_BY_NAME[m.dtype]).view(m.shape)
            for m in metas}


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
        _update(h, flat[i:i + _CHUNK])
    return h.hexdigest()


def state_dict_checksum(state_dict: Mapping[str, torch.Tensor]) -> str:
    """The checksum the PS publishes for this state dict."""
    return flat_checksum(*flatten(state_dict))


# ---- persistence (safetensors format, written and read without copies) --------------------
class VersionWriter:
    """Streams one version to `<dir>/v{version}.safetensors` as its bytes arrive; nothing
    is visible until commit() (fsync, rename, then the JSON sidecar, written last)."""

    def __init__(self, data_dir: Path, version: int, metas: list[TensorMeta]):
        self.data_dir, self.version = data_dir, version
        self.path = data_dir / f"v{version}.safetensors"
        self.size = sum(m.nbytes for m in metas)
        hdr = {m.name: {"dtype": m.dtype, "shape": list(m.shape),
                        "data_offsets": [m.offset, m.offset + m.nbytes]} for m in metas}
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


# ---- transfers ---------------------------------------------------------------------------
def _group(store: TCPStore, rank: int, backend: str, local_host: str, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = PrefixStore("staleflow-ps", store)
    if backend == "gloo":
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
        return ProcessGroupGloo(prefix, rank, 2, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL  # only in CUDA builds

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(prefix, rank, 2, opts)
    raise ValueError(f"unknown backend {backend!r}")


def _chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[i:i + _CHUNK] for i in range(0, flat.numel(), _CHUNK)]


def _send(pg, flat: torch.Tensor, peer: int, on_chunk: Callable[[torch.Tensor], None] | None = None) -> None:
    """Post every chunk, run on_chunk over them in order while they go out, then wait."""
    chunks = _chunks(flat)
    works = [pg.send([c], peer, k) for k, c in enumerate(chunks)]
    for c in chunks if on_chunk else ():
        on_chunk(c)
    for w in works:
        w.wait()


def _recv(pg, flat: torch.Tensor, peer: int, on_chunk: Callable[[torch.Tensor], None] | None = None) -> None:
    """Post every chunk; as each arrives (in order) run on_chunk while later ones stream."""
    chunks = _chunks(flat)
    works = [pg.recv([c], peer, k) for k, c in enumerate(chunks)]
    for w, c in zip(works, chunks):
        w.wait()
        if on_chunk:
            on_chunk(c)


# ---- server ------------------------------------------------------------------------------
@dataclass
class _Version:
    version: int
    flat: torch.Tensor
    metas: list[TensorMeta]
    checksum: str
    location: str
    pulls: int = 0  # transfers in flight

    def info(self) -> dict:
        return {"version": self.version, "size": self.flat.numel(), "checksum": self.checksum,
                "location": self.location}


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # a restarted PS rebinds its port at once
    daemon_threads = True


class ParamServer:
    def __init__(self, data_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0, *,
                 backend: str = "gloo", device: str = "cpu",
                 on_published: OnPublished | None = None, transfer_timeout_s: float = 300.0,
                 _tamper_pulls: bool = False):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.backend, self.device = backend, torch.device(device)
        self.on_published = on_published
        self.timeout_s = transfer_timeout_s
        self._tamper_pulls = _tamper_pulls  # test hook: corrupt bytes in transit
        self._lock = threading.Lock()
        self._push_lock = threading.Lock()  # one push at a time keeps versions ordered
        self._versions: dict[int, _Version] = {}
        self._latest: int | None = None
        self._load_latest_from_disk()
        ps = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                ps._handle(self)

        self._server = _Server((host, port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    def start(self) -> tuple[str, int]:
        if self._latest is not None:  # a crash may have come between persist and hook
            self._notify(self._versions[self._latest])
        self._thread = threading.Thread(target=self._server.serve_forever, name="ps", daemon=True)
        self._thread.start()
        return self.address

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def latest(self) -> dict | None:
        with self._lock:
            return self._versions[self._latest].info() if self._latest is not None else None

    def _load_latest_from_disk(self) -> None:
        sides = []
        for p in self.data_dir.glob("v*.json"):
            try:
                sides.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                log.warning("ignoring unreadable %s", p)
        if not sides:
            return
        side = max(sides, key=lambda s: s["version"])
        path = self.data_dir / side["file"]
        flat, metas, checksum = load_version(path, side["checksum"])  # raises if corrupt
        self._versions[side["version"]] = _Version(side["version"], flat.to(self.device), metas,
                                                   checksum, str(path))
        self._latest = side["version"]
        log.info("serving v%d from %s", self._latest, path)

    # -- protocol --
    def _handle(self, h: socketserver.StreamRequestHandler) -> None:
        def reply(obj: dict) -> None:
            h.wfile.write(json.dumps(obj).encode() + b"\n")
            h.wfile.flush()

        try:
            req = json.loads(h.rfile.readline() or b"{}")
            op = req.get("op")
            if op == "latest":
                reply({"latest": self.latest()})
            elif op == "pull":
                self._serve_pull(h, req, reply)
            elif op == "push":
                self._serve_push(h, req, reply)
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as e:  # one bad request must not take the server down
            log.exception("request failed")
            try:
                reply({"error": f"{type(e).__name__}: {e}"})
            except OSError:
                pass

    def _open_transfer(self, h) -> tuple[TCPStore, str]:
        local = h.connection.getsockname()[0]  # the address this peer reached us on
        store = TCPStore(local, 0, 2, True, datetime.timedelta(seconds=self.timeout_s),
                         wait_for_workers=False)
        return store, local

    def _serve_pull(self, h, req: dict, reply) -> None:
        with self._lock:
            v = self._latest if req.get("version") is None else int(req["version"])
            entry = self._versions.get(v) if v is not None else None
            if entry is None:
                reply({"error": f"version {req.get('version')} not available (latest {self._latest})"})
                return
            entry.pulls += 1
        try:
            store, local = self._open_transfer(h)
            reply({**entry.info(), "meta": _metas_json(entry.metas), "store_port": store.port,
                   "backend": self.backend})
            pg = _group(store, 0, self.backend, local, self.timeout_s)
            flat = entry.flat
            if self._tamper_pulls:
                flat = flat.clone()
                flat[flat.numel() // 2] ^= 0x5A
            _send(pg, flat, 1)
            h.rfile.readline()  # the peer's ack: it has everything, tear down is safe
            del pg
        finally:
            with self._lock:
                entry.pulls -= 1
                self._prune()

    def _serve_push(self, h, req: dict, reply) -> None:
        """Receive, hash and write to disk chunk by chunk as the bytes arrive; the sender's
        checksum comes after the data (it hashes while sending). Publish only if equal."""
        version = int(req["version"])
        with self._push_lock:
            with self._lock:
                latest = self._versions.get(self._latest) if self._latest is not None else None
            if latest is not None and version < latest.version:
                reply({"error": f"push of v{version} but v{latest.version} is published"})
                return
            metas = _metas_from_json(req["meta"])
            store, local = self._open_transfer(h)
            reply({"store_port": store.port, "backend": self.backend})
            pg = _group(store, 0, self.backend, local, self.timeout_s)
            flat = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device=self.device)
            hasher = _hasher(metas)
            writer = VersionWriter(self.data_dir, version, metas)
            try:
                _recv(pg, flat, 1, on_chunk=lambda c: (_update(hasher, c), writer.write(c)))
                claimed = json.loads(h.rfile.readline() or b"{}").get("checksum")
                checksum = hasher.hexdigest()
                if checksum != claimed:
                    raise ChecksumError(f"push of v{version}: received {checksum[:12]}, sender {str(claimed)[:12]}")
                if latest is not None and version == latest.version:
                    writer.abort()  # a retried push is fine, other weights under its number not
                    if checksum != latest.checksum:
                        raise ParamServerError(f"push of v{version} but v{latest.version} is published")
                    self._notify(latest)  # the first attempt's hook may have failed
                    reply({"ok": True, **latest.info(), "duplicate": True})
                    return
                path = writer.commit(checksum)
            except BaseException:
                writer.abort()
                raise
            entry = _Version(version, flat, metas, checksum, str(path))
            with self._lock:
                self._versions[version] = entry
                self._latest = version
                self._prune()
            self._remove_old_files(version)
            self._notify(entry)
            reply({"ok": True, **entry.info()})
            del pg
        log.info("published v%d (%d bytes, %s)", version, flat.numel(), checksum[:12])

    def _notify(self, e: _Version) -> None:
        if self.on_published is not None:
            self.on_published(e.version, e.flat.numel(), e.checksum, e.location)

    def _prune(self) -> None:
        for v in [v for v, e in self._versions.items() if v != self._latest and e.pulls == 0]:
            del self._versions[v]

    def _remove_old_files(self, keep: int) -> None:
        for p in self.data_dir.glob("v*.*"):
            stem = p.name.split(".", 1)[0]
            if stem[1:].isdigit() and int(stem[1:]) < keep:
                p.unlink(missing_ok=True)


# ---- client ------------------------------------------------------------------------------
class ParamClient:
    """Talks to a PS at "host:port" (or (host, port)). Thread-safe: no shared state."""

    def __init__(self, addr: str | tuple[str, int], timeout_s: float = 300.0):
        if isinstance(addr, str):
            host, port = addr.rsplit(":", 1)
            addr = (host, int(port))
        self.addr = (addr[0], int(addr[1]))
        self.timeout_s = timeout_s

    def _connect(self, req: dict):
        sock = socket.create_connection(self.addr, timeout=self.timeout_s)
        f = sock.makefile("rwb")
        f.write(json.dumps(req).encode() + b"\n")
        f.flush()
        return sock, f

    @staticmethod
    def _read(f) -> dict:
        line = f.readline()
        if not line:
            raise ParamServerError("PS closed the connection")
        msg = json.loads(line)
        if "error" in msg:
            err = msg["error"]
            raise (ChecksumError if err.startswith("ChecksumError") else ParamServerError)(err)
        return msg

    def _join(self, sock: socket.socket, msg: dict):
        store = TCPStore(self.addr[0], msg["store_port"], 2, False,
                         datetime.timedelta(seconds=self.timeout_s))
        return store, _group(store, 1, msg["backend"], sock.getsockname()[0], self.timeout_s)

    def latest(self) -> dict | None:
        """{"version", "size", "checksum", "location"} of the latest version, or None."""
        sock, f = self._connect({"op": "latest"})
        with sock, f:
            return self._read(f)["latest"]

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> str:
        """Send a new version; returns its checksum once the PS has verified, persisted and
        published it. Re-pushing the published version with the same weights is a no-op."""
        first = next(iter(state_dict.values()), None)
        dev = first.device if first is not None and first.is_cuda else "cpu"
        flat, metas = flatten(state_dict, dev)  # a snapshot: training may go on meanwhile
        sock, f = self._connect({"op": "push", "version": int(version), "meta": _metas_json(metas)})
        with sock, f:
            msg = self._read(f)
            store, pg = self._join(sock, msg)
            if msg["backend"] == "gloo" and flat.is_cuda:
                flat = flat.cpu()
            hasher = _hasher(metas)
            _send(pg, flat, 0, on_chunk=lambda c: _update(hasher, c))
            f.write(json.dumps({"checksum": hasher.hexdigest()}).encode() + b"\n")
            f.flush()
            done = self._read(f)  # after the PS verified and persisted
            del pg, store
        return done["checksum"]

    def pull(self, version: int | None = None, device: str | torch.device = "cpu",
             verify: bool = True, _on_reply: Callable[[dict], None] | None = None
             ) -> tuple[dict[str, torch.Tensor], int, str]:
        """Fetch `version` (latest if None): (state_dict, version, checksum). The tensors
        are views into one buffer. Raises ChecksumError if the bytes do not match."""
        sock, f = self._connect({"op": "pull", "version": version})
        with sock, f:
            msg = self._read(f)
            if _on_reply is not None:
                _on_reply(msg)  # test hook: hold the transfer in flight
            metas = _metas_from_json(msg["meta"])
            store, pg = self._join(sock, msg)
            recv_dev = device if msg["backend"] == "nccl" else "cpu"
            flat = torch.empty(msg["size"], dtype=torch.uint8, device=recv_dev)
            hasher = _hasher(metas)
            _recv(pg, flat, 0, on_chunk=(lambda c: _update(hasher, c)) if verify else None)
            f.write(b'{"ack": true}\n')
            f.flush()
            del pg, store
        if verify:
            got = hasher.hexdigest()
            if got != msg["checksum"]:
                raise ChecksumError(f"pulled v{msg['version']}: {got[:12]} != published {msg['checksum'][:12]}")
        flat = flat.to(device)
        return unflatten(flat, metas), msg["version"], msg["checksum"]


# ---- process entry -----------------------------------------------------------------------
def main(data_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0, *,
         backend: str = "gloo", device: str = "cpu", on_published: OnPublished | None = None,
         ready_file: str | os.PathLike | None = None, transfer_timeout_s: float = 300.0,
         _tamper_pulls: bool = False) -> None:
    """Run a PS until SIGTERM/SIGINT. With port=0 the bound address is written to
    `ready_file` (JSON: host, port, pid) once the PS serves requests."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ps %(levelname)s %(message)s")
    ps = ParamServer(data_dir, host, port, backend=backend, device=device,
                     on_published=on_published, transfer_timeout_s=transfer_timeout_s,
                     _tamper_pulls=_tamper_pulls)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    h, p = ps.start()
    if ready_file is not None:
        tmp = Path(f"{ready_file}.tmp")
        tmp.write_text(json.dumps({"host": h, "port": p, "pid": os.getpid()}))
        os.replace(tmp, ready_file)
    log.info("PS listening on %s:%d (%s), dir %s", h, p, backend, data_dir)
    stop.wait()
    ps.stop()

