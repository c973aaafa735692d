"""Weights for a tensor-parallel instance: one rank pulls, the others get each bucket by
broadcast inside the instance.

Why not have each rank receive only its own shard: vLLM's loaders take whole checkpoint
tensors and cut them themselves (each parameter's `weight_loader` narrows to the rank's
slice, fuses q/k/v, gate/up...), so the PS would have to re-implement every model's sharding.
Instead rank 0 of the TP group streams the version from the PS bucket by bucket
(ParamClient.pull_into) and broadcasts each bucket to the other ranks (NCCL on GPUs) before
loading it itself: the PS sends the model once per instance, not once per rank, and every
rank holds one bucket at a time.

`group` is anything with `rank_in_group`, `world_size`, `broadcast(tensor, src)` and
`broadcast_object(obj, src)`: vLLM's GroupCoordinator (`get_tp_group()`), or a plain
torch.distributed group in the tests. Rank 0 tells the others what comes next:
("begin", version) at the start of each attempt (a pull retried after a PS outage starts
over), ("bucket", Bucket) before each bucket's bytes, ("end", None) once the bytes are all
in and checked, and then ("done", version) or ("failed", reason).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from workers.trainer.param_store import Bucket, tensors_of
from workers.trainer.param_transport import RecvAccount

# install(version, (name, tensor) ...): load a version's tensors into this rank's model
Install = Callable[[int, Iterator[tuple[str, torch.Tensor]]], None]
# pull(load) -> version: one rank-0 pull from the PS (e.g. ParamClient.pull_served)
Pull = Callable[[Callable[[int, Iterator[tuple[Bucket, torch.Tensor]]], None]], int]


class _Restart(Exception):
    """Rank 0 began again or gave up while this rank was loading."""

    def __init__(self, msg: tuple[str, Any]):
        self.msg = msg


def pull_shared(
    group: Any, pull: Pull, install: Install, device: str | torch.device, account: RecvAccount | None = None
) -> int:
    """Every rank of `group` installs the version rank 0 pulls; returns it. Only rank 0 calls
    `pull`. `account`: what this rank held (rank 0's receive is the PS client's)."""
    if group is None or group.world_size == 1:
        return pull(lambda v, received: install(v, tensors_of(received)))
    if group.rank_in_group == 0:
        return _lead(group, pull, install)
    return _follow(group, install, device, account if account is not None else RecvAccount())


def _lead(group: Any, pull: Pull, install: Install) -> int:
    def load(version: int, received: Iterator[tuple[Bucket, torch.Tensor]]) -> None:
        group.broadcast_object(("begin", version), src=0)

        def relayed() -> Iterator[tuple[Bucket, torch.Tensor]]:
            for b, data in received:  # raises ChecksumError at the end on a mismatch
                group.broadcast_object(("bucket", b), src=0)
                group.broadcast(data, src=0)
                yield b, data
            group.broadcast_object(("end", None), src=0)

        install(version, tensors_of(relayed()))

    try:
        got = pull(load)
    except BaseException as e:
        group.broadcast_object(("failed", f"{type(e).__name__}: {e}"), src=0)
        raise
    group.broadcast_object(("done", got), src=0)
    return got


def _follow(group: Any, install: Install, device: str | torch.device, account: RecvAccount) -> int:
    buf: torch.Tensor | None = None

    def received() -> Iterator[tuple[Bucket, torch.Tensor]]:
        nonlocal buf
        while True:
            kind, arg = group.broadcast_object(None, src=0)
            if kind == "end":
                return
            if kind != "bucket":
                raise _Restart((kind, arg))
            if buf is None or buf.numel() < arg.nbytes:  # one buffer, grown to the largest bucket
                buf = None
                buf = torch.empty(arg.nbytes, dtype=torch.uint8, device=device)
                account.buffers += 1
                account.buffer_bytes = buf.numel()
            data = buf[: arg.nbytes]
            account.take(arg.nbytes)
            group.broadcast(data, src=0)
            yield arg, data
            account.give_back(arg.nbytes)

    msg = group.broadcast_object(None, src=0)
    while True:
        kind, arg = msg
        if kind == "done":
            return int(arg)
        if kind == "failed":
            raise RuntimeError(f"tensor-parallel rank 0's pull failed: {arg}")
        if kind != "begin":
            raise RuntimeError(f"unexpected message from tensor-parallel rank 0: {kind!r}")
        try:
            install(int(arg), tensors_of(received()))
            msg = group.broadcast_object(None, src=0)
        except _Restart as r:  # torn: rank 0 starts over ("begin") or gives up ("failed")
            msg = r.msg
