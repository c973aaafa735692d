"""Plain values of the wire that are not lifecycle states (those are in `enums`)."""

from __future__ import annotations

import enum


def is_run_id(ref: str) -> bool:
    """Whether a run reference (a path segment, a --run value) is an id: ASCII digits only
    (`str.isdigit` also takes '²'). Anything else is a name; names are never all digits."""
    return ref.isascii() and ref.isdigit()


class RouteOutcome(str, enum.Enum):
    ROUTED = "routed"
    NOT_QUEUED = "not_queued"  # already routed, finished or aborted
    INSTANCE_INACTIVE = "instance_inactive"
    TOO_OLD = "too_old"  # instance version below the sample's V_traj
    NOT_ADMITTED = "not_admitted"  # admission control: no buffer of the window has room
    JOIN_REFUSED = "join_refused"  # the group's buffer is outside this member's window
    GROUP_CLOSED = "group_closed"  # the group is already occupied or dropped
    WINDOW_READY = "window_ready"  # every buffer of the group's window is ready: no work at that version
