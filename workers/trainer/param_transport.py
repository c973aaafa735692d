"""How a weight version travels between the parameter server and a peer: a private two-rank
`torch.distributed` group per transfer (PS rank 0, peer rank 1) rendezvousing through a
TCPStore, and the flat uint8 buffer (workers.trainer.param_store) sent in chunks. The client
and the server both use it; neither reaches into the other. A group is bound to its control
connection's session (workers.trainer.param_auth): its rendezvous keys are named by the
session's secret and the client's rank proves it before any data moves."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from workers.trainer.param_auth import check_peer, prove_peer
from workers.trainer.param_store import _CHUNK


def open_group(store: TCPStore, rank: int, backend: str, local_host: str, timeout_s: float, secret: str | None = None):
    """The transfer's group; with the session's `secret`, only a peer that holds it joins."""
    pg = _group(store, rank, backend, local_host, timeout_s, secret)
    if rank == 0:
        check_peer(pg, secret, 1)
    else:
        prove_peer(pg, secret, 0)
    return pg


def _group(store: TCPStore, rank: int, backend: str, local_host: str, timeout_s: float, secret: str | None):
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = PrefixStore("staleflow-ps" if secret is None else f"staleflow-ps/{secret}", store)
    if backend == "gloo":
        # Private, so not in torch's stubs; the only way to give gloo a timeout and device.
        # Bound since torch 1.x (2.11 and 2.13 both have it); should a release drop it, the
        # public constructor still gives the timeout (gloo then picks its own device).
        if not hasattr(ProcessGroupGloo, "_Options"):
            return ProcessGroupGloo(prefix, rank, 2, timeout)
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
    return [flat[i : i + _CHUNK] for i in range(0, flat.numel(), _CHUNK)]


def send_flat(pg, flat: torch.Tensor, peer: int, on_chunk: Callable[[torch.Tensor], None] | None = None) -> None:
    """Post every chunk, run on_chunk over them in order while they go out, then wait."""
    chunks = _chunks(flat)
    works = [pg.send([c], peer, k) for k, c in enumerate(chunks)]
    if on_chunk is not None:
        for c in chunks:
            on_chunk(c)
    for w in works:
        w.wait()


def recv_flat(pg, flat: torch.Tensor, peer: int, on_chunk: Callable[[torch.Tensor], None] | None = None) -> None:
    """Post every chunk; as each arrives (in order) run on_chunk while later ones stream."""
    chunks = _chunks(flat)
    works = [pg.recv([c], peer, k) for k, c in enumerate(chunks)]
    for w, c in zip(works, chunks):
        w.wait()
        if on_chunk:
            on_chunk(c)
