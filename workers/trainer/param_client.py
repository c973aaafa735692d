"""Parameter-server client and transfers: what trainers and rollout instances run to push and
pull weight versions (the protocol is described in workers.trainer.param_server).

Each transfer builds its own two-rank `torch.distributed` group (PS rank 0, peer rank 1)
through a TCPStore the PS opens for it; a state dict travels as one flat uint8 buffer
(workers.trainer.param_store). The client rides through a PS restart when asked to (`retry_for`).
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch.distributed import TCPStore

from workers.retry import PARAM_SERVER, Outage
from workers.trainer.param_auth import PSAuthError, PSCredentials, connect
from workers.trainer.param_store import (
    ChecksumError,
    ParamServerError,
    _hasher,
    _metas_from_json,
    _metas_json,
    _update,
    flatten,
    unflatten,
)
from workers.trainer.param_transport import open_group, recv_flat, send_flat

log = logging.getLogger("staleflow.ps")


# ---- client ------------------------------------------------------------------------------
_T = TypeVar("_T")


class PSUnavailable(ParamServerError):
    """The PS went away mid-request (closed the connection, or the transfer broke)."""


def _ps_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, (OSError, PSUnavailable))


@contextmanager
def _transfer() -> Iterator[None]:
    """A torch.distributed transfer that breaks because the PS died is an outage, not a bug."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, ParamServerError):
            raise
        raise PSUnavailable(f"transfer broke: {e}") from e


class ParamClient:
    """Talks to a PS at "host:port" (or (host, port)). Thread-safe: no shared state."""

    def __init__(
        self,
        addr: str | tuple[str, int],
        timeout_s: float = 300.0,
        retry_for: float | None = 0.0,
        credentials: PSCredentials | None = None,
    ):
        """`retry_for`: seconds to ride through a PS that is down or restarting (connection
        refused or lost mid-transfer), None for ever (long-running workers), 0 for one try.
        Refusals (unknown version, checksum mismatch, PSAuthError) are raised at once.
        `credentials`: the run's PS key for this client's role (`PSCredentials.fetch`); None
        only talks to a PS that authenticates nobody."""
        if isinstance(addr, str):
            host, port = addr.rsplit(":", 1)
            addr = (host, int(port))
        self.addr = (addr[0], int(addr[1]))
        self.timeout_s = timeout_s
        self.retry_for = retry_for
        self.outage = Outage(f"parameter server {self.addr[0]}:{self.addr[1]}", log)
        self.credentials = credentials
        # each connection's session secret, for its transfer's group (_join)
        self._sessions: weakref.WeakKeyDictionary[socket.socket, str | None] = weakref.WeakKeyDictionary()

    def _call(self, fn: Callable[[], _T]) -> _T:
        """One PS request, retried while the PS is unreachable; every request is idempotent
        (a re-push of the same weights, a re-commit of the same checksum are no-ops)."""
        if self.retry_for == 0:
            return fn()
        for attempt in PARAM_SERVER.but(retry_for=self.retry_for).retrying(self.outage, _ps_unavailable):
            with attempt:
                out = fn()
        self.outage.ok()
        return out

    def _connect(self, req: dict):
        sock = socket.create_connection(self.addr, timeout=self.timeout_s)
        f = sock.makefile("rwb")
        try:
            self._sessions[sock] = connect(f, f, self.credentials, f"{self.addr[0]}:{self.addr[1]}").secret
        except BaseException:
            f.close()
            sock.close()
            raise
        f.write(json.dumps(req).encode() + b"\n")
        f.flush()
        return sock, f

    @staticmethod
    def _read(f) -> dict:
        line = f.readline()
        if not line:
            raise PSUnavailable("PS closed the connection")
        msg = json.loads(line)
        if "error" in msg:
            err = msg["error"]
            if err.startswith("PSAuthError"):
                raise PSAuthError(err)
            raise (ChecksumError if err.startswith("ChecksumError") else ParamServerError)(err)
        return msg

    def _join(self, sock: socket.socket, msg: dict):
        store = TCPStore(self.addr[0], msg["store_port"], 2, False, datetime.timedelta(seconds=self.timeout_s))
        secret = self._sessions.get(sock)
        return store, open_group(store, 1, msg["backend"], sock.getsockname()[0], self.timeout_s, secret)

    def latest(self) -> dict | None:
        """{"version", "size", "checksum", "location"} of the latest version, or None."""
        return self._call(self._latest)

    def _latest(self) -> dict | None:
        sock, f = self._connect({"op": "latest"})
        with sock, f:
            return self._read(f)["latest"]

    def commit(self, version: int, checksum: str) -> dict:
        """Tell the PS that `version` was published with `checksum`: from now on it serves only
        those weights under that number. ParamServerError if it holds other weights."""
        return self._call(lambda: self._commit(version, checksum))

    def _commit(self, version: int, checksum: str) -> dict:
        sock, f = self._connect({"op": "commit", "version": int(version), "checksum": checksum})
        with sock, f:
            return self._read(f)

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> str:
        """Send a new version; returns its checksum once the PS has verified, persisted and
        published it. Re-pushing the published version with the same weights is a no-op."""
        return self._call(lambda: self._push(state_dict, version))

    def _push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> str:
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
            with _transfer():
                send_flat(pg, flat, 0, on_chunk=lambda c: _update(hasher, c))
            f.write(json.dumps({"checksum": hasher.hexdigest()}).encode() + b"\n")
            f.flush()
            done = self._read(f)  # after the PS verified and persisted
            del pg, store
        return done["checksum"]

    def pull(
        self,
        version: int | None = None,
        device: str | torch.device = "cpu",
        verify: bool = True,
        _on_reply: Callable[[dict], None] | None = None,
        checksum: str | None = None,
    ) -> tuple[dict[str, torch.Tensor], int, str]:
        """Fetch `version`: (state_dict, version, checksum). The tensors are views into one
        buffer. Without `checksum` only committed weights are served: `version` if it is
        committed, the latest committed one if None; ParamServerError otherwise (e.g. in the
        window between a push and its commit). With `checksum` (the published one) `version`
        (the latest pushed if None) is served only if it holds exactly those weights, else
        ChecksumError. ChecksumError also if the received bytes do not match."""
        return self._call(lambda: self._pull(version, device, verify, _on_reply, checksum))

    def _pull(
        self,
        version: int | None,
        device: str | torch.device,
        verify: bool,
        _on_reply: Callable[[dict], None] | None,
        checksum: str | None,
    ) -> tuple[dict[str, torch.Tensor], int, str]:
        sock, f = self._connect({"op": "pull", "version": version, "checksum": checksum})
        with sock, f:
            msg = self._read(f)
            if _on_reply is not None:
                _on_reply(msg)  # test hook: hold the transfer in flight
            metas = _metas_from_json(msg["meta"])
            store, pg = self._join(sock, msg)
            recv_dev = device if msg["backend"] == "nccl" else "cpu"
            flat = torch.empty(msg["size"], dtype=torch.uint8, device=recv_dev)
            hasher = _hasher(metas)
            with _transfer():
                recv_flat(pg, flat, 0, on_chunk=(lambda c: _update(hasher, c)) if verify else None)
            f.write(b'{"ack": true}\n')
            f.flush()
            del pg, store
        if verify:
            got = hasher.hexdigest()
            if got != msg["checksum"]:
                raise ChecksumError(f"pulled v{msg['version']}: {got[:12]} != published {msg['checksum'][:12]}")
        flat = flat.to(device)
        return unflatten(flat, metas), msg["version"], msg["checksum"]
