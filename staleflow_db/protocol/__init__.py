"""The staleness protocol as PostgreSQL transactions (docs/protocol.md).

Every public method is one transaction. Methods that change buffer accounting (route,
record_rewards, aborts, publish) serialize on the run's row; the others are fenced by
attempt numbers instead. Refusals raise `staleflow_db.errors` exceptions and change nothing.
"""

from __future__ import annotations

from sqlalchemy import Engine

from .coordination import BufferView, CoordinationOps, InstanceView, QueuedView, RunningSample, Snapshot
from .reads import DashboardReads, InstanceOwner, MetricsRows, ParamVersion, ReadOps, RunInfo
from .rollout import Command, Poll, Prompt, RolloutOps, Work
from .scoring import RewardTask, ScoringOps
from .training import Batch, SegmentInfo, TrainGroup, TrainingOps, TrainSample


class Protocol(RolloutOps, ScoringOps, TrainingOps, CoordinationOps, ReadOps, DashboardReads):
    def __init__(self, engine: Engine):
        self.engine = engine


__all__ = [
    "Batch",
    "BufferView",
    "Command",
    "InstanceOwner",
    "InstanceView",
    "MetricsRows",
    "ParamVersion",
    "Poll",
    "Prompt",
    "Protocol",
    "QueuedView",
    "RewardTask",
    "RunningSample",
    "RunInfo",
    "SegmentInfo",
    "Snapshot",
    "TrainGroup",
    "TrainSample",
    "Work",
]
