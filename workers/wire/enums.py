"""Lifecycle states, mirrored one-to-one by PostgreSQL enum types (a test checks they agree).

The state machines (sample, group, buffer, instance, command) are drawn once, in
docs/protocol.md#state-machines, checked against the transitions the protocol performs.
"""

from __future__ import annotations

import enum


class SampleState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    SCORING = "scoring"
    REWARDED = "rewarded"
    ABORTED = "aborted"


class GroupState(str, enum.Enum):
    QUEUED = "queued"
    RESERVED = "reserved"
    OCCUPIED = "occupied"
    CONSUMED = "consumed"
    FILTERED = "filtered"
    ABORTED = "aborted"


class RunState(str, enum.Enum):
    """A run's lifecycle (docs/api.md, "Run lifecycle")."""

    ACTIVE = "active"
    PAUSED = "paused"  # nothing new is routed; in-flight work finishes, is scored and trains
    CANCELLED = "cancelled"  # terminal: unfinished work aborted; enqueue, route, consume refused


class InstanceState(str, enum.Enum):
    ACTIVE = "active"
    EXPIRED = "expired"
    DEREGISTERED = "deregistered"


class CommandKind(str, enum.Enum):
    INTERRUPT = "interrupt"
    ABORT = "abort"
    PULL = "pull"


class CommandState(str, enum.Enum):
    PENDING = "pending"
    DELIVERED = "delivered"


class SegmentKind(str, enum.Enum):
    """How a reported stretch of generation ended."""

    FINISHED = "finished"  # the sample is complete (EOS or max tokens)
    INTERRUPTED = "interrupted"  # back to the queue, tokens kept
    PARTIAL = "partial"  # a checkpoint: the sample keeps running


class Role(str, enum.Enum):
    ADMIN = "admin"
    ROLLOUT = "rollout"
    REWARD = "reward"
    TRAINER = "trainer"
    COORDINATOR = "coordinator"
    OBSERVER = "observer"  # reads everything of its run(s), writes nothing (the dashboard)


class DropReason(str, enum.Enum):
    """Why a sample or group was dropped; every drop carries one."""

    SURPLUS = "surplus"  # group-level redundancy: the group already had N members
    FILTERED = "filtered"  # DAPO dynamic sampling: all rewards equal
    WINDOW_READY = "window_ready"  # every buffer of the group's window became ready
    WINDOW_CLOSED = "window_closed"  # its buffer was consumed and no later one admits it
    NO_BUFFER = "no_buffer"  # finished, but no buffer of its window needed it any more
    INSUFFICIENT_MEMBERS = "insufficient_members"  # too many members aborted to reach N
    USER = "user"  # aborted on request
    REWARD_FAILED = "reward_failed"  # its reward function raised, returned no valid reward or timed out
    RUN_CANCELLED = "run_cancelled"  # its run was cancelled before it finished
    ENV_FAILED = "env_failed"  # its environment raised or answered with no step (multi-turn)
    ENV_TIMEOUT = "env_timeout"  # its environment did not answer in time (multi-turn)


TERMINAL_GROUP_STATES = frozenset({GroupState.CONSUMED, GroupState.FILTERED, GroupState.ABORTED})
