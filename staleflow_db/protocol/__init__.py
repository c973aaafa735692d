"""The staleness protocol as PostgreSQL transactions (docs/protocol.md), by capability.

`Protocol` is the write side, composed of one class per actor's capability, each on the core
(`core`: the run lock, buffer accounting, drops, fences, transactions):

- `runs.RunOps`: create a run, enqueue prompts;
- `rollout.RolloutOps`: instances and their leases, work delivery, segment reports;
- `node.NodeOps`: several instances' reports, heartbeats and polls in one transaction;
- `scoring.ScoringOps`: reward claims, recording rewards (Occupy, the DAPO filter), reward drops;
- `training.TrainingOps`: consume, publish;
- `coordination.CoordinationOps`, `routing.RoutingOps`, `aborts.AbortOps`: the coordinator's
  leadership, snapshot and commands (routes, interrupts, pulls, drops).

`ProtocolReads` (`reads`, also `Protocol.reads`) is the read side: run lists and status,
audit views, metrics and dashboard reads, which never write.

Every public method is one transaction. Methods that change buffer accounting (route,
record_rewards, aborts, publish) serialize on the run's row; the others are fenced by
attempt numbers instead. Refusals raise `staleflow_db.errors` exceptions and change nothing.
"""

from __future__ import annotations

from sqlalchemy import Engine

from .aborts import AbortOps
from .coordination import BufferView, CoordinationOps, InstanceView, QueuedView, RunningSample, Snapshot, snapshot_of
from .core import Prompt
from .node import NodeDelivery, NodeHeartbeat, NodeItem, NodeOps, NodeOutcome
from .reads import InstanceOwner, MetricsRows, ParamVersion, ProtocolReads, RunInfo
from .rollout import Command, Poll, RolloutOps, Work
from .routing import RoutingOps
from .runs import RunOps
from .scoring import RewardTask, ScoringOps
from .training import Batch, SegmentInfo, TrainGroup, TrainingOps, TrainSample


class Protocol(RunOps, NodeOps, RolloutOps, ScoringOps, TrainingOps, CoordinationOps, RoutingOps, AbortOps):
    """The write side; its reads are `reads`."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.reads = ProtocolReads(engine)


__all__ = [
    "Batch",
    "BufferView",
    "Command",
    "InstanceOwner",
    "InstanceView",
    "MetricsRows",
    "NodeDelivery",
    "NodeHeartbeat",
    "NodeItem",
    "NodeOutcome",
    "ParamVersion",
    "Poll",
    "Prompt",
    "Protocol",
    "ProtocolReads",
    "QueuedView",
    "RewardTask",
    "RunningSample",
    "RunInfo",
    "SegmentInfo",
    "Snapshot",
    "snapshot_of",
    "TrainGroup",
    "TrainSample",
    "Work",
]
