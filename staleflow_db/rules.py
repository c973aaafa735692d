"""Pure buffer-placement rules of the staleness protocol (SPEC §2).

Both the in-memory reference model and the PostgreSQL implementation call these functions on
the buffer counters they hold, so the placement policy is written exactly once. Buffers that
do not exist yet count as empty (they are created lazily).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping


@dataclass
class BufferCounts:
    """Accounting of one staleness buffer: entries are EMPTY, RESERVED or OCCUPIED."""

    index: int
    occupied: int = 0
    reserved: int = 0
    consumed: bool = False


@dataclass(frozen=True)
class Limits:
    batch_size: int  # B: occupied groups that make a buffer ready
    capacity: int  # B' >= B: entries per buffer
    eta: int  # staleness bound


def buffer_state(buf: BufferCounts | None, limits: Limits) -> str:
    if buf is None:
        return "waiting"
    if buf.consumed:
        return "consumed"
    if buf.occupied >= limits.batch_size:
        return "ready"
    if buf.occupied + buf.reserved < limits.capacity:
        return "waiting"
    return "stuck"


def _admits(buf: BufferCounts | None, limits: Limits) -> bool:
    """A buffer takes a new entry only while it still needs occupied groups and has room."""
    if buf is None:
        return True
    if buf.consumed or buf.occupied >= limits.batch_size:
        return False
    return buf.occupied + buf.reserved < limits.capacity


def window(group_version: int, version_now: int, limits: Limits) -> range:
    """Buffers a group of version V may land in: [V, V+eta], minus those already consumed."""
    return range(max(group_version, version_now), group_version + limits.eta + 1)


def reserve_target(
    buffers: Mapping[int, BufferCounts], group_version: int, version_now: int, limits: Limits
) -> int | None:
    """Reserve takes the latest admissible buffer (worst-case placement)."""
    for b in reversed(window(group_version, version_now, limits)):
        if _admits(buffers.get(b), limits):
            return b
    return None


def occupy_target(
    buffers: Mapping[int, BufferCounts], group_version: int, version_now: int, limits: Limits
) -> int | None:
    """Occupy takes the earliest admissible buffer (greedy), after its reservation is released."""
    for b in window(group_version, version_now, limits):
        if _admits(buffers.get(b), limits):
            return b
    return None


def window_has_room(
    buffers: Mapping[int, BufferCounts], group_version: int, version_now: int, limits: Limits
) -> bool:
    """False once every buffer of the window is ready or consumed (abort-after-ready)."""
    for b in window(group_version, version_now, limits):
        buf = buffers.get(b)
        if buf is None or (not buf.consumed and buf.occupied < limits.batch_size):
            return True
    return False


@dataclass(frozen=True)
class Reservation:
    group_id: int
    buffer: int
    max_buffer: int  # the group's window upper end: min member version + eta


def cascade_moves(
    freed_buffer: int,
    buffers: Mapping[int, BufferCounts],
    reservations: Iterable[Reservation],
    limits: Limits,
) -> list[tuple[int, int, int]]:
    """Moves (group_id, from, to) that keep reservations as late as possible after a release.

    A slot freed in buffer b is taken by the reservation in the earliest buffer before b whose
    window still contains b; that frees a slot further back, and so on. Counters in `buffers`
    are updated in place; the caller persists them and the moved groups.
    """
    by_group = {r.group_id: r for r in reservations}
    moves: list[tuple[int, int, int]] = []
    target = freed_buffer
    while True:
        if not _admits(buffers.get(target), limits):
            return moves
        candidates = [r for r in by_group.values() if r.buffer < target <= r.max_buffer]
        if not candidates:
            return moves
        mover = min(candidates, key=lambda r: (r.buffer, r.group_id))
        source = mover.buffer
        buffers[source].reserved -= 1
        buffers[target].reserved += 1
        by_group[mover.group_id] = Reservation(mover.group_id, target, mover.max_buffer)
        moves.append((mover.group_id, source, target))
        target = source


def route_decision(
    has_tokens: bool,
    v_traj: int | None,
    last_version: int | None,
    instance_version: int,
    group_reserved_buffer: int | None,
    buffers: Mapping[int, BufferCounts],
    version_now: int,
    limits: Limits,
) -> tuple[str, int | None, int | None]:
    """Where routing one queued sample of a live group leads: (outcome, V_traj, buffer to reserve).

    A sample with no tokens yet takes the instance's version (version raise; an instance
    older than a V_traj it already has is refused); one with tokens keeps its V_traj and may
    only continue at a version >= its latest segment's. The group's first routed member
    reserves (admission control); later members join only if the group's buffer lies in their
    window. Outcomes are `RouteOutcome` values.
    """
    floor = 0 if v_traj is None else max(v_traj, last_version if last_version is not None else v_traj)
    if instance_version < floor:  # V_traj only grows, and segment versions never decrease
        return "too_old", None, None
    v = instance_version if not has_tokens else v_traj
    if group_reserved_buffer is None:
        b = reserve_target(buffers, v, version_now, limits)
        return ("routed", v, b) if b is not None else ("not_admitted", None, None)
    if v + limits.eta < group_reserved_buffer:
        return "join_refused", None, None
    return "routed", v, None
