"""Re-exports of workers.wire.enums, where the lifecycle states live (shared with workers that
do not install the database stack)."""

from workers.wire.enums import (
    TERMINAL_GROUP_STATES,
    CommandKind,
    CommandState,
    DropReason,
    GroupState,
    InstanceState,
    Role,
    SampleState,
    SegmentKind,
)

__all__ = [
    "TERMINAL_GROUP_STATES",
    "CommandKind",
    "CommandState",
    "DropReason",
    "GroupState",
    "InstanceState",
    "Role",
    "SampleState",
    "SegmentKind",
]
