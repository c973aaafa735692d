"""A ready batch as JSON with its token ids and log-probs packed (workers.wire.packed): what
`consume?packed=true` answers. The JSON lists of a batch of B x N samples are most of its bytes
and of the CPU of serialising it (a log-prob read from a float4 prints as ~20 characters). The
shape is ConsumeOut's; `prompt_tokens`, `tokens` and `logprobs` are packed strings, the rest
(masks of 0/1 among them: shorter as lists) as in the list form."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import TypeAdapter
from typing_extensions import TypedDict

from staleflow_db.protocol.training import Batch, SegmentInfo, TrainGroup, TrainSample
from workers.wire.packed import pack_float32, pack_int32


class _Sample(TypedDict):
    sample_id: int
    idx: int
    v_traj: int
    tokens: str
    logprobs: str
    reward: float
    finish_reason: str | None
    segments: list[SegmentInfo]
    loss_mask: list[int]


class _Group(TypedDict):
    group_id: int
    group_version: int
    prompt_tokens: str
    meta: dict[str, Any]
    samples: list[_Sample]


class _Batch(TypedDict):
    run_id: int
    version: int
    consume_fence: int
    groups: list[_Group]


class _Consume(TypedDict):
    ready: bool
    version: int
    batch: _Batch


@functools.cache
def _adapter() -> TypeAdapter[_Consume]:
    return TypeAdapter(_Consume)


def _sample(s: TrainSample) -> _Sample:
    return {
        "sample_id": s.sample_id,
        "idx": s.idx,
        "v_traj": s.v_traj,
        "tokens": pack_int32(s.tokens),
        "logprobs": pack_float32(s.logprobs),  # float4 values: exact in float32
        "reward": s.reward,
        "finish_reason": s.finish_reason,
        "segments": s.segments,
        "loss_mask": s.loss_mask,
    }


def _group(g: TrainGroup) -> _Group:
    return {
        "group_id": g.group_id,
        "group_version": g.group_version,
        "prompt_tokens": pack_int32(g.prompt_tokens),
        "meta": g.meta,
        "samples": [_sample(s) for s in g.samples],
    }


def consumed_json(version: int, batch: Batch) -> bytes:
    """The ConsumeOut of a ready batch, its arrays packed."""
    packed: _Batch = {
        "run_id": batch.run_id,
        "version": batch.version,
        "consume_fence": batch.consume_fence,
        "groups": [_group(g) for g in batch.groups],
    }
    return _adapter().dump_json({"ready": True, "version": version, "batch": packed})
