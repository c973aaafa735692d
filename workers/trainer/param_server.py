"""Parameter server (PS): the trainer pushes weight versions, rollout instances pull them.

Design
  * Control: a small TCP server speaking JSON lines -- `latest`, `pull`, `push`. One
    connection per request; it stays open for the duration of that transfer.
  * Access: every connection first passes the handshake of workers.trainer.param_auth (the
    run's PS key for the role its request needs); a refused one is answered, logged and
    closed before its request is read. Each transfer's group is bound to that session.
  * Data: `torch.distributed` point-to-point. Each transfer gets its own two-rank group
    (PS rank 0, peer rank 1) rendezvousing through a TCPStore the PS opens on a free port.
    Groups are built directly as ProcessGroupGloo/ProcessGroupNCCL objects rather than
    via `init_process_group`, whose single default group per process would forbid
    concurrent transfers and peers that come and go (vLLM's weight sync does the same).
  * Layout and integrity (workers.trainer.param_store): a state dict travels as ONE flat uint8
    buffer in canonical order -- the same bytes as the data section of the safetensors
    file the PS persists -- and its checksum covers every tensor's name, dtype, shape and
    bytes. The PS checks pushes against the trainer's checksum, pullers check what they
    received, a restarted PS checks the file on disk; each raises ChecksumError on a
    mismatch.
  * Versions: the PS keeps the latest and the latest committed in memory (usually the same
    one), and an older one only while pulls of it are in flight. On disk it keeps those two
    (`<dir>/v{version}.safetensors` plus its `.json` sidecar, see workers.trainer.param_store).
  * Publication: a pushed version is provisional until the trainer that PUBLISHED it (in the
    database, fenced by its consume fence) commits its checksum here (`commit`). A push of
    a provisional version with other weights replaces it (a fenced trainer may have pushed
    first); once committed, the version's weights are final and another push of it is
    refused -- so pullers never get a zombie trainer's weights under a published version.
    Pullers may also name the checksum they expect (the published one); the PS refuses a
    pull whose weights differ.
  * Pulls in buckets: a pull may name a bucket size; the PS then sends the version as
    buckets of whole tensors (param_store.buckets) so the puller holds one at a time.
  * Serving: a pull that names no checksum gets only COMMITTED weights -- the latest
    committed version, or the requested one only if it is committed -- so no puller loads a
    provisional version (possibly a zombie's) in the window between a push and its commit.
    The PS therefore keeps the latest committed version (memory and disk) beside a newer
    provisional one. A pull naming the published checksum may get a provisional version
    holding exactly those weights. Version 0 (the initial weights) is committed by the
    trainer right after it pushes it at start-up.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed import TCPStore

from workers.trainer.param_auth import HANDSHAKE_TIMEOUT_S, PSAuthError, PSKeys, Session, accept, authorize
from workers.trainer.param_store import (
    ChecksumError,
    ParamServerError,
    TensorMeta,
    VersionWriter,
    _hasher,
    _metas_from_json,
    _metas_json,
    _update,
    buckets,
    load_version,
)
from workers.trainer.param_transport import open_group, recv_flat, send_flat

log = logging.getLogger("staleflow.ps")


# on_published(version, size_bytes, checksum, location): called once a version is on disk
# and served, again on a retried push of it, and at start-up for the version loaded from
# disk -- so it must be idempotent (e.g. an upsert of the version's row).
OnPublished = Callable[[int, int, str, str], None]


# ---- server ------------------------------------------------------------------------------
@dataclass
class _Version:
    version: int
    flat: torch.Tensor
    metas: list[TensorMeta]
    checksum: str
    location: str
    pulls: int = 0  # transfers in flight
    committed: bool = False  # its checksum is the published one: no other push may replace it

    def info(self) -> dict:
        return {
            "version": self.version,
            "size": self.flat.numel(),
            "checksum": self.checksum,
            "location": self.location,
            "committed": self.committed,
        }


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # a restarted PS rebinds its port at once
    daemon_threads = True


class ParamServer:
    def __init__(
        self,
        data_dir: str | os.PathLike,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backend: str = "gloo",
        device: str = "cpu",
        on_published: OnPublished | None = None,
        transfer_timeout_s: float = 300.0,
        auth: PSKeys | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        _tamper_pulls: bool = False,
    ):
        """`auth`: the run's PS keys (workers.trainer.param_auth); every connection must prove
        one within `handshake_timeout_s`. None authenticates nobody: for a PS and its clients
        inside one program only."""
        self.auth, self.handshake_timeout_s = auth, handshake_timeout_s
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.backend, self.device = backend, torch.device(device)
        self.on_published = on_published
        self.timeout_s = transfer_timeout_s
        self._tamper_pulls = _tamper_pulls  # test hook: corrupt bytes in transit
        self._lock = threading.Lock()
        self._push_lock = threading.Lock()  # one push at a time keeps versions ordered
        self._versions: dict[int, _Version] = {}
        self._latest: int | None = None  # the latest pushed version (maybe provisional)
        self._committed: int | None = None  # the latest committed one: what plain pulls get
        self._load_latest_from_disk()
        ps = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                ps._handle(self)

        self._server = _Server((host, port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server's address
        return host, port

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
        latest = max(sides, key=lambda s: s["version"])
        committed = max((s for s in sides if s.get("committed")), key=lambda s: s["version"], default=None)
        for side in {id(s): s for s in (latest, committed) if s is not None}.values():
            path = self.data_dir / side["file"]
            flat, metas, checksum = load_version(path, side["checksum"])  # raises if corrupt
            self._versions[side["version"]] = _Version(
                side["version"], flat.to(self.device), metas, checksum, str(path), committed=bool(side.get("committed"))
            )
            log.info(
                "loaded v%d (%s) from %s",
                side["version"],
                "committed" if side.get("committed") else "provisional",
                path,
            )
        self._latest = latest["version"]
        self._committed = committed["version"] if committed is not None else None

    # -- protocol --
    def _handle(self, h: socketserver.StreamRequestHandler) -> None:
        def reply(obj: dict) -> None:
            h.wfile.write(json.dumps(obj).encode() + b"\n")
            h.wfile.flush()

        try:
            session = accept(h.connection, h.rfile, h.wfile, self.auth, self.handshake_timeout_s)
        except (PSAuthError, OSError) as e:  # nothing of the peer's is read or served
            # a peer that hangs up before a byte (a TCP probe) is no refusal worth a warning
            level = logging.WARNING if isinstance(e, PSAuthError) else logging.DEBUG
            log.log(level, "refused connection from %s: %s", h.client_address[0], e)
            try:
                reply({"error": f"PSAuthError: {e}"})
            except OSError:
                pass
            return
        h.session = session  # type: ignore[attr-defined]  # binds the transfer's group to it
        try:
            req = json.loads(h.rfile.readline() or b"{}")
            op = req.get("op")
            try:
                authorize(session, op)
            except PSAuthError as e:
                log.warning("refused %s from %s (%s): %s", op, h.client_address[0], session.role, e)
                reply({"error": f"PSAuthError: {e}"})
                return
            if op == "latest":
                reply({"latest": self.latest()})
            elif op == "pull":
                self._serve_pull(h, req, reply)
            elif op == "push":
                self._serve_push(h, req, reply)
            elif op == "commit":
                reply(self.commit(int(req["version"]), str(req["checksum"])))
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
        store = TCPStore(local, 0, 2, True, datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        return store, local

    def _serve_pull(self, h, req: dict, reply) -> None:
        with self._lock:
            want = req.get("checksum")
            v: int | None
            if req.get("version") is not None:
                v = int(req["version"])
            else:  # without a checksum to check, only committed (published) weights are served
                v = self._latest if want is not None else self._committed
            entry = self._versions.get(v) if v is not None else None
            if entry is None:
                reply(
                    {
                        "error": f"version {req.get('version')} not available (latest pushed {self._latest}, "
                        f"latest committed {self._committed})"
                    }
                )
                return
            if want is not None and want != entry.checksum:
                reply(
                    {"error": f"ChecksumError: v{v} here is {entry.checksum[:12]}, not the expected {str(want)[:12]}"}
                )
                return
            if want is None and not entry.committed:
                reply(
                    {
                        "error": f"version {v} is not committed yet (provisional until its publisher commits "
                        f"it; latest committed {self._committed})"
                    }
                )
                return
            entry.pulls += 1
        try:
            # a puller that streams into its loader names its bucket size: same plan both ends
            spans = [(b.start, b.end) for b in buckets(entry.metas, req.get("bucket_bytes"))]
            store, local = self._open_transfer(h)
            reply({**entry.info(), "meta": _metas_json(entry.metas), "store_port": store.port, "backend": self.backend})
            pg = open_group(store, 0, self.backend, local, self.timeout_s, _secret(h))
            flat = entry.flat
            if self._tamper_pulls:
                flat = flat.clone()
                flat[flat.numel() // 2] ^= 0x5A
            send_flat(pg, flat, 1, spans=spans)
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
            pg = open_group(store, 0, self.backend, local, self.timeout_s, _secret(h))
            flat = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device=self.device)
            hasher = _hasher(metas)
            writer = VersionWriter(self.data_dir, version, metas)

            def on_chunk(chunk: torch.Tensor) -> None:  # hash and persist while receiving
                _update(hasher, chunk)
                writer.write(chunk)

            try:
                recv_flat(pg, flat, 1, on_chunk=on_chunk)
                claimed = json.loads(h.rfile.readline() or b"{}").get("checksum")
                checksum = hasher.hexdigest()
                if checksum != claimed:
                    raise ChecksumError(f"push of v{version}: received {checksum[:12]}, sender {str(claimed)[:12]}")
                if latest is not None and version == latest.version and checksum == latest.checksum:
                    writer.abort()  # a retried push
                    self._notify(latest)  # the first attempt's hook may have failed
                    reply({"ok": True, **latest.info(), "duplicate": True})
                    return
                if latest is not None and version == latest.version and latest.committed:
                    # other weights under a published number: a fenced trainer's push
                    raise ParamServerError(
                        f"push of v{version}: v{version} is published with checksum "
                        f"{latest.checksum[:12]}, not {checksum[:12]}"
                    )
                path = writer.commit(checksum)
            except BaseException:
                writer.abort()
                raise
            entry = _Version(version, flat, metas, checksum, str(path))
            with self._lock:
                self._versions[version] = entry
                self._latest = version
                self._prune()
                keep = self._oldest_kept()
            self._remove_old_files(keep)
            self._notify(entry)
            reply({"ok": True, **entry.info()})
            del pg
        log.info("published v%d (%d bytes, %s)", version, flat.numel(), checksum[:12])

    def commit(self, version: int, checksum: str) -> dict:
        """Pin `version` to the published `checksum` (the publishing trainer calls this)."""
        with self._push_lock, self._lock:
            entry = self._versions.get(version)
            if entry is None:
                if self._latest is not None and version < self._latest:
                    return {"ok": True, "superseded": True}  # a newer version is served anyway
                return {"error": f"commit of v{version}: not pushed (latest {self._latest})"}
            if entry.checksum != checksum:
                return {"error": f"commit of v{version}: the PS holds {entry.checksum[:12]}, not {checksum[:12]}"}
            if not entry.committed:
                _mark_committed(self.data_dir, version)
                entry.committed = True
            if self._committed is None or version > self._committed:
                self._committed = version
                self._prune()
                self._remove_old_files(self._oldest_kept())
            return {"ok": True, **entry.info()}

    def _notify(self, e: _Version) -> None:
        if self.on_published is not None:
            self.on_published(e.version, e.flat.numel(), e.checksum, e.location)

    def _prune(self) -> None:
        """Keep the latest, the latest committed and any version still being pulled."""
        keep = (self._latest, self._committed)
        for v in [v for v, e in self._versions.items() if v not in keep and e.pulls == 0]:
            del self._versions[v]

    def _oldest_kept(self) -> int:
        """Files older than this version may go: neither the latest nor the latest committed."""
        return min(v for v in (self._latest, self._committed) if v is not None)

    def _remove_old_files(self, keep: int) -> None:
        for p in self.data_dir.glob("v*.*"):
            stem = p.name.split(".", 1)[0]
            if stem[1:].isdigit() and int(stem[1:]) < keep:
                p.unlink(missing_ok=True)


def _secret(h) -> str | None:
    session: Session = h.session
    return session.secret


def _mark_committed(data_dir: Path, version: int) -> None:
    """Record the commit in the version's sidecar (atomically), so a restarted PS keeps it."""
    side_path = data_dir / f"v{version}.json"
    side = json.loads(side_path.read_text())
    side["committed"] = True
    tmp = data_dir / f"v{version}.json.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(side))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, side_path)


# ---- process entry -----------------------------------------------------------------------
def main(
    data_dir: str | os.PathLike,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    backend: str = "gloo",
    device: str = "cpu",
    on_published: OnPublished | None = None,
    ready_file: str | os.PathLike | None = None,
    transfer_timeout_s: float = 300.0,
    auth: PSKeys | None = None,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    _tamper_pulls: bool = False,
) -> None:
    """Run a PS until SIGTERM/SIGINT. With port=0 the bound address is written to
    `ready_file` (JSON: host, port, pid) once the PS serves requests."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ps %(levelname)s %(message)s")
    ps = ParamServer(
        data_dir,
        host,
        port,
        backend=backend,
        device=device,
        on_published=on_published,
        transfer_timeout_s=transfer_timeout_s,
        auth=auth,
        handshake_timeout_s=handshake_timeout_s,
        _tamper_pulls=_tamper_pulls,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    h, p = ps.start()
    if ready_file is not None:
        tmp = Path(f"{ready_file}.tmp")
        tmp.write_text(json.dumps({"host": h, "port": p, "pid": os.getpid()}))
        os.replace(tmp, ready_file)
    who = f"run {auth.run_id}'s PS keys required" if auth else "NO authentication"
    log.info("PS listening on %s:%d (%s), dir %s; %s", h, p, backend, data_dir, who)
    stop.wait()
    ps.stop()
