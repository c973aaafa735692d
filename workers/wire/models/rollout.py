"""Rollout instances: registration, heartbeats with snapshots, work delivery, segment reports."""

from __future__ import annotations

from typing import Annotated, Any
from uuid import UUID

from pydantic import Field, Strict

from ..enums import DropReason, SegmentKind
from .common import (
    INT32_MAX,
    INT64_MAX,
    Attempt,
    Bool,
    Count,
    Finite,
    Id,
    In,
    Int,
    LeaseSeconds,
    LogProbs,
    Name,
    Number,
    Out,
    TokenIds,
    Version,
)

Positive = Annotated[int, Strict(), Field(ge=1, le=INT32_MAX)]


class Capacity(In):
    """What an engine holds at once (docs/coordinator.md#capacity). The coordinator routes an
    instance no more requests than `max_running` and estimates its KV fullness against
    `kv_capacity`. An instance that reports none is routed one request at a time, with room for
    one longest sample of the run."""

    max_running: Positive = Field(description="most requests the engine runs at once (vLLM: max_num_seqs)")
    kv_capacity: Positive = Field(description="tokens the engine's KV cache holds in all")


class RegisterIn(In):
    name: Name = Field(description="a label (host, GPU); the id is new on every registration")
    version: Version = Field(description="model version the instance has loaded")
    lease_seconds: LeaseSeconds = 30.0
    capacity: Capacity | None = Field(None, description="the engine's capacity, known to the first cycle")


class RegisterOut(Out):
    instance_id: int
    run_id: int
    lease_seconds: float


class RunningSampleIn(In):
    sample_id: Id
    tokens: Count = Field(description="response tokens generated so far (all segments)")
    turn_tokens: Count | None = Field(None, description="multi-turn: tokens of its current turn so far")
    env_waited_s: Number | None = Field(
        None,
        ge=0.0,
        le=1e9,
        allow_inf_nan=False,
        description="multi-turn: seconds it has waited for its environment at the snapshot (absent: not waiting)",
    )


class InstanceSnapshotIn(In):
    """What the coordinator needs to route (docs/coordinator.md): load, KV cache, per-sample progress."""

    # running and waiting: in the engine (not the trajectories waiting for their environment)
    running: Count = 0
    waiting: Count = 0
    kv_used: Count = Field(0, description="KV-cache tokens held (trajectories waiting for their environment: none)")
    env_waiting: Count = Field(0, description="trajectories held between turns, waiting for their environment")
    running_samples: list[RunningSampleIn] = Field(default_factory=list, max_length=100_000)
    throughput: Number = Field(0.0, ge=0.0, le=1e12, allow_inf_nan=False, description="generated tokens/s")
    pulling: Bool = False
    routed_seen: Int | None = Field(None, ge=0, le=INT64_MAX, description="cumulative routed requests taken in")
    capacity: Capacity | None = Field(None, description="the engine's capacity; left out: the latest reported stays")


class HeartbeatIn(In):
    version: Version
    snapshot: InstanceSnapshotIn = Field(default_factory=lambda: InstanceSnapshotIn.model_validate({}))
    lease_seconds: LeaseSeconds = 30.0


class HeartbeatOut(Out):
    instance_id: int
    lease_seconds: float


class DeregisterOut(Out):
    instance_id: int
    requeued: list[int] = Field(description="samples that went back to the queue")


class WorkOut(Out):
    """A routed sample: generate after `prompt_tokens + prefix_tokens` (prefix empty when fresh)."""

    sample_id: int
    attempt: int = Field(description="number of this route; quote it in every report on this sample")
    route_token: str = Field(
        description="secret token of this route (random, unguessable); quote it in every report on this sample"
    )
    group_id: int
    v_traj: int
    prompt_tokens: list[int]
    prefix_tokens: list[int]
    prefix_logprobs: list[float]
    max_new_tokens: int
    prefix_mask: list[int] = Field(
        default_factory=list,
        description="per prefix token: 1 generated, 0 an environment observation's (multi-turn trajectories)",
    )
    meta: dict[str, Any] = Field(default_factory=dict, description="the prompt's metadata (an environment reads it)")


class CommandOut(Out):
    id: int
    kind: str = Field(description="interrupt, abort or pull")
    sample_id: int | None
    attempt: int | None
    target_version: int | None


class PollOut(Out):
    """The one shape of a poll reply: each part is always present, empty when there is none of it."""

    work: list[WorkOut] = Field(default_factory=list, description="samples newly routed to the instance")
    commands: list[CommandOut] = Field(default_factory=list, description="interrupt, abort and pull commands")


class ReportIn(In):
    """A segment of a sample routed to the reporting instance (the instance in the path)."""

    sample_id: Id
    attempt: Attempt
    route_token: UUID = Field(description="the route token delivered with the work by poll")
    version: Version | None = Field(
        None, description="model version that generated these tokens; none for an observation"
    )
    tokens: TokenIds = Field(description="token ids: a JSON list, or packed (base64 of little-endian int32)")
    logprobs: LogProbs = Field(
        default_factory=list,
        description="one per token, none for an observation: a JSON list, or packed (base64 of little-endian float32)",
    )
    kind: SegmentKind = SegmentKind.FINISHED
    finish_reason: Name | None = None
    generated: Bool = Field(
        True,
        description="false: an environment observation appended between turns (no version, loss mask 0; "
        "its kind partial or interrupted)",
    )


class ReportsIn(In):
    reports: list[ReportIn] = Field(min_length=1)
    snapshot: InstanceSnapshotIn | None = Field(
        None, description="the instance's snapshot now, stored as a heartbeat's (its version unchanged)"
    )


class ReportsOut(Out):
    applied: int


class TrajectoryDropIn(In):
    sample_id: Id
    attempt: Attempt = Field(description="the route's attempt: fences the drop like a report")
    route_token: UUID = Field(description="the route token delivered with the work by poll")


class TrajectoryDropsIn(In):
    drops: list[TrajectoryDropIn] = Field(min_length=1)
    reason: DropReason = Field(
        DropReason.ENV_FAILED,
        description="recorded on each sample dropped: env_failed or env_timeout, the ones a rollout instance may give",
    )


class ExpireOut(Out):
    expired: list[int]


__all__ = [
    "Capacity",
    "CommandOut",
    "DeregisterOut",
    "ExpireOut",
    "Finite",
    "HeartbeatIn",
    "HeartbeatOut",
    "InstanceSnapshotIn",
    "PollOut",
    "RegisterIn",
    "RegisterOut",
    "ReportIn",
    "ReportsIn",
    "ReportsOut",
    "RunningSampleIn",
    "TrajectoryDropIn",
    "TrajectoryDropsIn",
    "WorkOut",
]
