"""Reward workers (claim, score) and the trainer (consume, publish)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from ..enums import DropReason, GroupState
from ..packed import PACKED_LOGPROBS, PACKED_TOKEN_IDS
from .common import INT64_MAX, Attempt, ClaimSeconds, Finite, Id, In, Int, Location, Name, Out

# Arrays of a batch or a claim: JSON lists, or packed strings (consume?packed=true,
# claim?packed=true) read into lists
TokenList = Annotated[list[int], PACKED_TOKEN_IDS]
FloatList = Annotated[list[float], PACKED_LOGPROBS]

# A reward's extra metrics: {name: finite number}, at most 64 (staleflow_db.protocol.scoring).
MetricName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00]*$")]
Metrics = Annotated[dict[MetricName, Finite], Field(max_length=64)]


class ClaimIn(In):
    limit: Int = Field(100, ge=1, le=10_000)
    claim_seconds: ClaimSeconds = Field(60.0, description="unscored claims become claimable again after this")


class RewardTaskOut(Out):
    sample_id: int
    reward_attempt: int = Field(description="fences the reward for this claim")
    group_id: int
    prompt_tokens: TokenList
    response_tokens: TokenList
    finish_reason: str | None
    meta: dict[str, Any]
    response_mask: list[int] = Field(
        default_factory=list,
        description="per response token: 1 generated, 0 an environment observation's (multi-turn trajectories)",
    )


class ClaimOut(Out):
    tasks: list[RewardTaskOut]


class RewardIn(In):
    sample_id: Id
    reward_attempt: Attempt
    reward: Finite
    metrics: Metrics | None = Field(
        None, description="extra metrics of this reward ({name: number}), kept with it and shown per step"
    )


class RewardsIn(In):
    rewards: list[RewardIn] = Field(min_length=1)


class RewardDropIn(In):
    sample_id: Id
    reward_attempt: Attempt = Field(description="the claim's attempt: fences the drop like a reward")


class RewardDropsIn(In):
    drops: list[RewardDropIn] = Field(min_length=1)
    reason: DropReason = Field(
        DropReason.REWARD_FAILED,
        description="recorded on each sample dropped; reward_failed is the one a reward worker may give",
    )


class GroupOutcomeOut(Out):
    group_id: int
    state: GroupState
    buffer: int | None = None
    reason: str | None = None
    replacement: int | None = Field(None, description="group enqueued in place of a filtered one")


class RewardsOut(Out):
    groups: list[GroupOutcomeOut] = Field(description="groups that completed (occupied, filtered or dropped)")


class SegmentInfoOut(Out):
    seq: int
    version: int | None = Field(description="the model version that generated it; none for an observation")
    instance_id: int
    n_tokens: int
    generated: bool = Field(True, description="false: an environment observation (multi-turn), loss mask 0")


class TrainSampleOut(Out):
    sample_id: int
    idx: int
    v_traj: int
    tokens: TokenList
    logprobs: FloatList
    reward: float
    finish_reason: str | None
    segments: list[SegmentInfoOut]
    loss_mask: list[int] = Field(
        description="per token of `tokens`: 1 generated (train on it), 0 an environment observation's"
    )


class TrainGroupOut(Out):
    group_id: int
    group_version: int
    prompt_tokens: TokenList
    meta: dict[str, Any]
    samples: list[TrainSampleOut]


class BatchOut(Out):
    run_id: int
    version: int = Field(description="the buffer: trains model `version` into `version + 1`")
    consume_fence: int = Field(description="publish quoting this fence; a later consume of the buffer fences it")
    groups: list[TrainGroupOut]


class ConsumeOut(Out):
    ready: bool
    version: int
    batch: BatchOut | None = Field(None, description="the whole batch once the buffer is ready")


class PublishIn(In):
    consume_fence: Attempt = Field(description="the consume fence of the batch (BatchOut.consume_fence)")
    size_bytes: Int | None = Field(None, ge=0, le=INT64_MAX)
    checksum: Name | None = None
    location: Location | None = Field(None, description="where instances pull the parameters from")
    metrics: Metrics | None = Field(
        None, description="what the trainer reports of the step (its loss ...), kept with the version"
    )


class PublishOut(Out):
    version: int = Field(description="the run's version after publishing")


__all__ = [
    "BatchOut",
    "ClaimIn",
    "ClaimOut",
    "ConsumeOut",
    "GroupOutcomeOut",
    "PublishIn",
    "PublishOut",
    "RewardDropIn",
    "RewardDropsIn",
    "RewardIn",
    "RewardTaskOut",
    "RewardsIn",
    "RewardsOut",
    "SegmentInfoOut",
    "TrainGroupOut",
    "TrainSampleOut",
]
