"""How a weight version travels between the parameter server and a peer: a private two-rank
`torch.distributed` group per transfer (PS rank 0, peer rank 1) rendezvousing through a
TCPStore, and the flat uint8 buffer (workers.trainer.param_store) sent in chunks. The client
and the server both use it; neither reaches into the other. A group is bound to its control
connection's session (workers.trainer.param_auth): its rendezvous keys are named by the
session's secret and the client's rank proves it before any data moves.

A pull may be cut into buckets (spans of the flat buffer): the sender posts every chunk of
every span at once (it holds the whole buffer anyway); the receiver posts one span's chunks
at a time into ONE reusable buffer and hands it out before posting the next, so it never
holds more than one bucket (RecvAccount records what it held)."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


Spans = list[tuple[int, int]]  # [start, end) byte ranges of the flat buffer, in order


def _chunks(flat: torch.Tensor, spans: Spans | None = None) -> list[torch.Tensor]:
    """The messages: each span (default: all of `flat`) cut into chunks; message k has tag k."""
    return [
        flat[i : min(i + _CHUNK, end)]
        for start, end in (spans or [(0, flat.numel())])
        for i in range(start, end, _CHUNK)
    ]


def send_flat(
    pg,
    flat: torch.Tensor,
    peer: int,
    on_chunk: Callable[[torch.Tensor], None] | None = None,
    spans: Spans | None = None,
) -> None:
    """Post every chunk (of every span), run on_chunk over them in order while they go out,
    then wait."""
    chunks = _chunks(flat, spans)
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


@dataclass
class RecvAccount:
    """What a bucketed receive held (bytes): tests assert on it, the benchmark reports it."""

    buffers: int = 0  # receive buffers allocated (one per transfer)
    buffer_bytes: int = 0  # the largest one's size: the largest bucket
    buckets: int = 0  # buckets received
    received: int = 0  # bytes received
    in_flight: int = 0  # buckets posted for receive or handed out, not yet given back
    peak_in_flight: int = 0
    bytes_in_flight: int = 0
    peak_bytes: int = 0  # the most bytes posted or handed out at once

    def take(self, nbytes: int) -> None:
        self.in_flight += 1
        self.bytes_in_flight += nbytes
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_flight)

    def give_back(self, nbytes: int) -> None:
        self.in_flight -= 1
        self.bytes_in_flight -= nbytes
        self.buckets += 1
        self.received += nbytes


def recv_buckets(
    pg,
    peer: int,
    spans: Spans,
    device: str | torch.device,
    account: RecvAccount,
    on_chunk: Callable[[torch.Tensor], None] | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Receive the spans one at a time into one buffer; yield (span index, its bytes). The
    next span is posted only when the caller asks for it: what was yielded is then reused."""
    buf = torch.empty(max((end - start for start, end in spans), default=0), dtype=torch.uint8, device=device)
    account.buffers += 1
    account.buffer_bytes = max(account.buffer_bytes, buf.numel())
    tag = 0
    for i, (start, end) in enumerate(spans):
        view = buf[: end - start]
        chunks = _chunks(view)
        account.take(view.numel())
        works = [pg.recv([c], peer, tag + k) for k, c in enumerate(chunks)]
        tag += len(chunks)
        for w, c in zip(works, chunks):
            w.wait()
            if on_chunk:
                on_chunk(c)
        yield i, view
        account.give_back(view.numel())
