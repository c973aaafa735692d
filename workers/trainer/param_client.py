"""Parameter-server client and transfers: what trainers and rollout instances run to push and
pull weight versions (the protocol is described in workers.trainer.param_server).

Each transfer builds its own two-rank `torch.distributed` group (PS rank 0, peer rank 1)
through a TCPStore the PS opens for it; a state dict travels as one flat uint8 buffer
(workers.trainer.param_store), in the pusher's dtype. Pullers that install weights stream
them in buckets straight into their loader (`pull_into`), holding one bucket at a time. The
client rides through a PS restart when asked to (`retry_for`).
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.distributed import TCPStore

from workers.retry import PARAM_SERVER, PS_FIRST_VERSION, Outage
from workers.trainer.param_auth import PSAuthError, PSCredentials, connect
from workers.trainer.param_store import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    ChecksumError,
    ParamServerError,
    _hasher,
    _metas_from_json,
    _metas_json,
    _update,
    buckets,
    flatten,
    tensors_of,
)
from workers.trainer.param_transport import RecvAccount, open_group, recv_buckets, send_flat

log = logging.getLogger("staleflow.ps")


# ---- client ------------------------------------------------------------------------------
_T = TypeVar("_T")
# load(version, received): installs a streamed version from its (bucket, bytes) pairs, e.g.
# by copying param_store.tensors_of(received) into a model (see ParamClient.pull_into)
Loader = Callable[[int, Iterator[tuple[Bucket, torch.Tensor]]], None]


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

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int, dtype: torch.dtype | None = None) -> str:
        """Send a new version, floating tensors cast to `dtype` (None: as they are); returns
        its checksum once the PS has verified, persisted and published it. Re-pushing the
        published version with the same weights is a no-op."""
        return self._call(lambda: self._push(state_dict, version, dtype))

    def _push(self, state_dict: Mapping[str, torch.Tensor], version: int, dtype: torch.dtype | None) -> str:
        first = next(iter(state_dict.values()), None)
        dev = first.device if first is not None and first.is_cuda else "cpu"
        flat, metas = flatten(state_dict, dev, dtype)  # a snapshot: training may go on meanwhile
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
        """Fetch `version` whole: (state_dict, version, checksum). The tensors are views into
        one buffer (a full copy of the model: loaders use pull_into). Without `checksum` only
        committed weights are served: `version` if it is committed, the latest committed one
        if None; ParamServerError otherwise (e.g. in the window between a push and its
        commit). With `checksum` (the published one) `version` (the latest pushed if None) is
        served only if it holds exactly those weights, else ChecksumError. ChecksumError also
        if the received bytes do not match."""
        out: dict[str, torch.Tensor] = {}
        got, checksum = self._call(
            lambda: self._stream(
                version,
                checksum,
                device,
                verify,
                None,
                lambda v, received: out.update(tensors_of(received)),
                None,
                _on_reply,
            )
        )
        return out, got, checksum

    def pull_into(
        self,
        load: Loader,
        version: int | None = None,
        *,
        device: str | torch.device = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: bool = True,
        checksum: str | None = None,
        account: RecvAccount | None = None,
    ) -> tuple[int, str]:
        """Stream `version` (served as for pull) into `load(version, received)`, bucket by
        bucket: `received` yields (bucket, its bytes on `device`) -- param_store.tensors_of
        turns that into (name, tensor) in the pushed dtype -- and reuses the one buffer for
        the next bucket, so the loader copies what it keeps. At most one bucket of
        `bucket_bytes` (or one tensor, if larger) is held at a time; `account` records what
        was. The iterator raises ChecksumError at its end if the bytes do not match the
        published checksum, so a loader that installs a version only once it has run out
        installs neither a torn nor a tampered one. Returns (version, checksum)."""
        return self._call(lambda: self._stream(version, checksum, device, verify, bucket_bytes, load, account, None))

    def pull_served(
        self, load: Loader, version: int | None = None, *, wait_s: float = 0.0, **kw: Any
    ) -> tuple[int, str]:
        """pull_into `version`, or the latest committed one if the PS does not serve it (not
        committed yet, or dropped for a newer one); waits up to `wait_s` for the first
        committed version. What a rollout instance loads on a pull command."""
        if version is not None:
            try:
                return self.pull_into(load, version, **kw)
            except ChecksumError:
                raise
            except ParamServerError:
                pass  # not served: the latest committed one instead

        def nothing_yet(e: BaseException) -> bool:
            return isinstance(e, ParamServerError) and not isinstance(e, ChecksumError)

        fn = lambda: self.pull_into(load, None, **kw)  # noqa: E731
        if wait_s <= 0:
            return fn()
        return PS_FIRST_VERSION.but(retry_for=wait_s).retrying(retryable=nothing_yet)(fn)

    def _stream(
        self,
        version: int | None,
        checksum: str | None,
        device: str | torch.device,
        verify: bool,
        bucket_bytes: int | None,
        load: Loader,
        account: RecvAccount | None,
        _on_reply: Callable[[dict], None] | None,
    ) -> tuple[int, str]:
        req: dict[str, Any] = {"op": "pull", "version": version, "checksum": checksum}
        if bucket_bytes is not None:
            req["bucket_bytes"] = int(bucket_bytes)
        buckets([], bucket_bytes)  # a bad bucket size fails here, before the PS is asked
        sock, f = self._connect(req)
        with sock, f:
            msg = self._read(f)
            if _on_reply is not None:
                _on_reply(msg)  # test hook: hold the transfer in flight
            metas = _metas_from_json(msg["meta"])
            plan = buckets(metas, bucket_bytes)
            store, pg = self._join(sock, msg)
            hasher = _hasher(metas)
            recv_dev = torch.device(device if msg["backend"] == "nccl" else "cpu")
            received = recv_buckets(
                pg,
                0,
                [(b.start, b.end) for b in plan],
                recv_dev,
                account if account is not None else RecvAccount(),
                on_chunk=(lambda c: _update(hasher, c)) if verify else None,
            )
            # gloo into a GPU model: each bucket is copied into ONE reused device buffer, so the
            # GPU holds one bucket too (a fresh copy per bucket would overlap the previous one)
            staging = None
            if recv_dev != torch.device(device) and plan:
                staging = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8, device=device)

            def stream() -> Iterator[tuple[Bucket, torch.Tensor]]:
                while True:
                    with _transfer():
                        item = next(received, None)
                    if item is None:
                        break
                    i, data = item
                    yield plan[i], data if staging is None else staging[: data.numel()].copy_(data)
                if verify and (got := hasher.hexdigest()) != msg["checksum"]:
                    raise ChecksumError(f"pulled v{msg['version']}: {got[:12]} != published {msg['checksum'][:12]}")

            it = stream()
            load(msg["version"], it)
            for _ in it:  # what the loader left: received (and checked) all the same
                pass
            f.write(b'{"ack": true}\n')
            f.flush()
            del pg, store
        return msg["version"], msg["checksum"]
