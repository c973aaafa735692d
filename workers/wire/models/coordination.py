"""The coordinator's reads and writes, and the audit views."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from ..enums import DropReason
from ..types import RouteOutcome
from .common import INT64_MAX, Id, In, Int, Out, Version


class RunningOut(Out):
    sample_id: int
    tokens: int = Field(description="response tokens reported so far")
    prompt_tokens: int
    v_traj: int


class InstanceViewOut(Out):
    instance_id: int
    name: str
    version: int
    snapshot: dict[str, Any] = Field(description="as the instance last reported it (see InstanceSnapshotIn)")
    snapshot_age_s: float | None = Field(description="seconds since that snapshot; None: none yet")
    running: list[RunningOut] = Field(description="its running samples, from the database")


class QueuedSampleOut(Out):
    sample_id: int
    group_id: int
    v_traj: int | None = Field(description="None: fresh, takes the version of the instance it is routed to")
    last_version: int | None = Field(description="version of its latest segment")
    length: int = Field(description="prompt + response tokens so far: the KV it needs")
    tokens: int = Field(description="response tokens so far")
    group_state: str = Field(description="queued, reserved, ... of its group")
    group_buffer: int | None = Field(description="the group's reserved buffer (join rule), if any")
    group_min_version: int | None = Field(description="least V_traj of the group's routed members")
    last_instance: int | None = Field(description="instance of its latest segment, if any")


class SnapshotBufferOut(Out):
    index: int
    occupied: int
    reserved: int


class ClusterSnapshotOut(Out):
    """One read-only transaction: everything a coordinator cycle decides from (docs/coordinator.md)."""

    run_id: int
    version: int
    config: dict[str, Any]
    buffers: list[SnapshotBufferOut] = Field(description="unconsumed buffers")
    instances: list[InstanceViewOut] = Field(description="active instances with a live instance lease")
    queued: list[QueuedSampleOut]
    latest_params: int | None = Field(description="latest published parameter version")


class SnapshotChangesOut(Out):
    """The coordinator's snapshot as what changed since `since` (a previous read's `position`),
    or whole: rows are arrays in the field order of the full snapshot's (docs/coordinator.md,
    "Snapshot changes"); `workers.wire.snapshot_mirror.SnapshotMirror` merges them."""

    position: str = Field(description="the next read's `since`: the read's database snapshot (xmin:xmax:xip,...)")
    whole: bool = Field(description="the whole snapshot (no since, or too old): replace the copy")
    run: dict[str, Any] = Field(description="the run's version, state and configuration")
    buffers: list[list[int]] | None = Field(description="unconsumed buffers: [index, occupied, reserved]")
    live: list[list[Any]] | None = Field(description="every live instance: [id, heartbeat age s]")
    instances: list[list[Any]] | None = Field(description="live instances written since: [id, name, version, snapshot]")
    running: list[list[Any]] | None = Field(
        description="running samples changed since (all, whole): [instance, sample, tokens, prompt_tokens, v_traj]"
    )
    queued: list[list[Any]] | None = Field(
        description="queued samples changed since (all, whole), in QueuedSampleOut's field order"
    )
    gone: list[int] | None = Field(description="samples changed since that are neither queued nor running")
    latest_params: int | None = Field(description="latest published parameter version")


class Fenced(In):
    epoch: Int | None = Field(
        None,
        ge=0,
        le=INT64_MAX,
        description="coordinator leadership epoch; refused (409) unless it is the run's current leader epoch",
    )


class RouteItem(In):
    sample_id: Id
    instance_id: Id


class RouteIn(Fenced):
    routes: list[RouteItem] = Field(min_length=1)


class RouteResultOut(Out):
    sample_id: int
    outcome: RouteOutcome
    attempt: int | None = None
    v_traj: int | None = None
    buffer: int | None = None


class RouteOut(Out):
    results: list[RouteResultOut]


class InterruptIn(Fenced):
    sample_ids: list[Id] = Field(min_length=1)


class PullIn(Fenced):
    instance_ids: list[Id] = Field(min_length=1)
    target_version: Version | None = Field(None, description="default: the run's current version")


class CommandsOut(Out):
    commands: int = Field(description="commands queued (samples no longer running are skipped)")


class AbortSamplesIn(Fenced):
    sample_ids: list[Id] = Field(min_length=1)
    reason: DropReason = DropReason.USER


class AbortedOut(Out):
    aborted: list[int]


class DroppedGroupsOut(Out):
    groups: list[int] = Field(description="groups aborted")


class AbortGroupIn(Fenced):
    reason: DropReason = DropReason.USER


class AbortGroupOut(Out):
    group_id: int
    aborted: bool = Field(description="false when the group had already finished")


class TrainedSampleRow(Out):
    run_id: int
    step: int
    sample_id: int
    group_id: int
    idx: int
    v_traj: int
    staleness: int
    group_version: int
    group_staleness: int
    segment_versions: list[int] | None
    segment_instances: list[int] | None
    n_segments: int
    n_tokens: int
    reward: float | None
    finish_reason: str | None


class DroppedSampleRow(Out):
    run_id: int
    sample_id: int
    group_id: int
    idx: int
    reason: str | None
    group_state: str
    v_traj: int | None
    n_tokens: int
    n_segments: int
    dropped_at: datetime


class ViolationRow(Out):
    run_id: int
    invariant: str
    subject: str
    detail: str


class TrainedSamples(Out):
    rows: list[TrainedSampleRow]


class DroppedSamples(Out):
    rows: list[DroppedSampleRow]


class Violations(Out):
    rows: list[ViolationRow]
