"""Node sync: one process hosting several rollout instances (a GPU node) carries their reports,
lease renewals and snapshots in one call and one transaction, and long-polls for the work and
commands of all of them at once. Each instance keeps its own lease and fences: the outcome is
per instance (docs/api.md, "Node sync")."""

from __future__ import annotations

from pydantic import Field

from .common import Id, In, Out
from .rollout import CommandOut, HeartbeatIn, InstanceSnapshotIn, ReportIn, WorkOut

MAX_NODE_INSTANCES = 60  # instances in one sync: a savepoint each stays below PostgreSQL's 64 cached subtransactions


class NodeItemIn(In):
    """One instance's calls of this flush: its report (as POST .../segments, `snapshot` riding
    along) and/or a heartbeat (a version change, a snapshot no report carried). At least one."""

    instance_id: Id
    reports: list[ReportIn] = Field(default_factory=list, description="segments, as a report's")
    snapshot: InstanceSnapshotIn | None = Field(None, description="with `reports`: stored as a report's snapshot")
    heartbeat: HeartbeatIn | None = Field(None, description="a heartbeat, applied after the report")


class NodeSyncIn(In):
    items: list[NodeItemIn] = Field(default_factory=list, max_length=MAX_NODE_INSTANCES)
    poll: list[Id] = Field(
        default_factory=list,
        max_length=MAX_NODE_INSTANCES,
        description="instances to deliver work and commands for (a long-poll with `wait`, after the items)",
    )


class NodeErrorOut(Out):
    code: str
    message: str
    items: list[dict] = Field(default_factory=list, description="what a 409 names: {id, reason} each")


class NodeItemOut(Out):
    instance_id: int
    status: int = Field(description="200 applied; 409 refused (lease lapsed, a route lost): nothing of it applied")
    applied: int = Field(0, description="segments applied")
    error: NodeErrorOut | None = None


class NodeDeliveryOut(Out):
    instance_id: int
    status: int = Field(description="200 delivered (maybe nothing); 409 the instance is fenced: register again")
    work: list[WorkOut] = Field(default_factory=list)
    commands: list[CommandOut] = Field(default_factory=list)
    error: NodeErrorOut | None = None


class NodeSyncOut(Out):
    results: list[NodeItemOut] = Field(default_factory=list, description="one per item, in its order")
    deliveries: list[NodeDeliveryOut] = Field(default_factory=list, description="one per polled instance, in order")


__all__ = [
    "MAX_NODE_INSTANCES",
    "NodeDeliveryOut",
    "NodeErrorOut",
    "NodeItemIn",
    "NodeItemOut",
    "NodeSyncIn",
    "NodeSyncOut",
]
