"""Pure buffer-placement rules of the staleness protocol (docs/protocol.md).

Both the in-memory reference model and the PostgreSQL implementation call these functions on
the buffer counters they hold, so the placement policy is written exactly once. Buffers that
do not exist yet count as empty (they are created lazily).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from workers.wire.run_config import RunConfig


@dataclass
class BufferCounts:
    """Accounting of one staleness buffer: entries are EMPTY, RESERVED or OCCUPIED."""

    index: int
    occupied: int = 0
    reserved: int = 0
    consumed: bool = False


# The rules read a run's configuration: B (occupied groups that make a buffer ready), B'
# (entries per buffer) and eta (the staleness bound).
Limits = RunConfig


def buffer_state(buf: BufferCounts | None, limits: Limits) -> str:
    if buf is None:
        return "waiting"
    if buf.consumed:
        return "consumed"
    if buf.occupied >= limits.batch_size:
        return "ready"
    if buf.occupied + buf.reserved < limits.buffer_capacity:
        return "waiting"
    return "stuck"


def _admits(buf: BufferCounts | None, limits: Limits) -> bool:
    """A buffer takes a new entry only while it still needs occupied groups and has room."""
    if buf is None:
        return True
    if buf.consumed or buf.occupied >= limits.batch_size:
        return False
    return buf.occupied + buf.reserved < limits.buffer_capacity


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


def window_has_room(buffers: Mapping[int, BufferCounts], group_version: int, version_now: int, limits: Limits) -> bool:
    """False once every buffer of the window is ready or consumed (abort-after-ready)."""
    for b in window(group_version, version_now, limits):
        buf = buffers.get(b)
        if buf is None or (not buf.consumed and buf.occupied < limits.batch_size):
            return True
    return False


def pins_group_version(state: str, v_traj: int | None, n_tokens: int) -> bool:
    """Does this member's V_traj count toward its group's version (docs/protocol.md: min V_traj over
    the group's members)? Only a live member whose version can no longer change: aborted
    members are gone, and a queued member with no tokens has no trajectory yet (routed again,
    it takes the version of its new instance: version raise)."""
    if v_traj is None or state == "aborted":
        return False
    return state != "queued" or n_tokens > 0


def group_version(members: Iterable[tuple[str, int | None, int]]) -> int | None:
    """The live group version from (state, V_traj, tokens) of its members; None while no
    member pins one (then only the join rule constrains where it may still land)."""
    return min((v for st, v, n in members if v is not None and pins_group_version(st, v, n)), default=None)


@dataclass(frozen=True)
class Reservation:
    group_id: int
    buffer: int
    version: int | None  # the live group version (`group_version`)

    def window_end(self, limits: Limits) -> int:
        """The latest buffer it may move to; a group with no pinned version stays put."""
        return self.buffer if self.version is None else self.version + limits.eta


def _can_give_up(buf: BufferCounts | None, limits: Limits) -> bool:
    """A cascade never takes a reservation out of a ready (or consumed) buffer: that buffer
    trains without it, and the slot it would leave there is of no use to anyone."""
    return buf is not None and not buf.consumed and buf.occupied < limits.batch_size


def cascade_moves(
    freed_buffer: int,
    buffers: Mapping[int, BufferCounts],
    reservations: Iterable[Reservation],
    limits: Limits,
) -> list[tuple[int, int, int]]:
    """Moves (group_id, from, to) that keep reservations as late as possible after a release.

    A slot freed in buffer b is taken by the reservation in the earliest buffer before b whose
    window still contains b and which is not ready; that frees a slot further back, and so on.
    Callers place a group that releases its reservation to Occupy *before* the cascade runs,
    so the cascade can never take the slot the finishing group needs. Counters in `buffers`
    are updated in place; the caller persists them and the moved groups.
    """
    by_group = {r.group_id: r for r in reservations}
    moves: list[tuple[int, int, int]] = []
    target = freed_buffer
    while True:
        if not _admits(buffers.get(target), limits):
            return moves
        candidates = [
            r
            for r in by_group.values()
            if r.buffer < target <= r.window_end(limits) and _can_give_up(buffers.get(r.buffer), limits)
        ]
        if not candidates:
            return moves
        mover = min(candidates, key=lambda r: (r.buffer, r.group_id))
        source = mover.buffer
        buffers[source].reserved -= 1
        buffers[target].reserved += 1
        by_group[mover.group_id] = Reservation(mover.group_id, target, mover.version)
        moves.append((mover.group_id, source, target))
        target = source


def occupy_plan(
    freed: int,
    buffers: Mapping[int, BufferCounts],
    reservations: Iterable[Reservation],
    group_version: int,
    version_now: int,
    limits: Limits,
) -> tuple[int | None, list[tuple[int, int, int]]]:
    """Where a finishing group lands (Occupy), after it released its reservation in `freed`:
    (buffer or None, the reservation moves that make room there).

    The group is placed first. It takes the earliest buffer of its window that either has a
    free entry, or can be given one by the cascade that starts at `freed`: reservations move
    later one step each (never out of a ready buffer), and the group takes the slot the last
    move it needs leaves behind (on a tie the swap wins, so the buffer the group fills never
    keeps a reservation that could have moved on). With no move, the caller cascades from
    `freed` once the group is placed (if it landed elsewhere). `buffers` is not changed.
    """
    trial = {
        b: BufferCounts(c.index, c.occupied, c.reserved, c.consumed) for b, c in buffers.items() if b >= version_now
    }
    chain = cascade_moves(freed, trial, reservations, limits)
    win = window(group_version, version_now, limits)
    direct = occupy_target(buffers, group_version, version_now, limits)
    best = None  # sources are decreasing: the last one inside the window is the earliest
    for k, (_, source, _) in enumerate(chain):
        if source in win:
            best = k
    if best is not None and (direct is None or chain[best][1] <= direct):
        return chain[best][1], chain[: best + 1]
    return direct, []


def apply_moves(buffers: Mapping[int, BufferCounts], moves: Iterable[tuple[int, int, int]]) -> None:
    for _, source, target in moves:
        buffers[source].reserved -= 1
        buffers[target].reserved += 1


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
    window, and only while their version's window still has a buffer that needs groups: once
    every buffer of it is ready, no group holding a member of that version can land (every
    buffer it could still use lies in that window), so no more work is routed at that version
    (docs/protocol.md, abort after ready). Outcomes are `RouteOutcome` values.
    """
    floor = 0 if v_traj is None else max(v_traj, last_version if last_version is not None else v_traj)
    if instance_version < floor:  # V_traj only grows, and segment versions never decrease
        return "too_old", None, None
    v = v_traj if has_tokens and v_traj is not None else instance_version  # a sample with tokens has its V_traj
    if group_reserved_buffer is None:
        b = reserve_target(buffers, v, version_now, limits)
        return ("routed", v, b) if b is not None else ("not_admitted", None, None)
    if v + limits.eta < group_reserved_buffer:
        return "join_refused", None, None
    if not window_has_room(buffers, v, version_now, limits):
        return "window_ready", None, None
    return "routed", v, None


REPLACEMENT_PREFIX = "~r"  # client keys may not start with "~": replacements own that namespace


def replacement_key(client_key: str) -> str:
    """The key of the prompt that replaces a filtered group: `~r<depth>:<original key>`.

    Unique without a lookup (a group is filtered at most once, and clients may not use the
    `~` prefix), bounded in length however often a prompt is replaced, and the same in the
    database and the reference model. `{key}~r` was not: a client key of that form made the
    replacement's insert a no-op, and the filtered prompt was silently lost."""
    depth, root = 0, client_key
    if client_key.startswith(REPLACEMENT_PREFIX) and ":" in client_key:
        head, root = client_key[len(REPLACEMENT_PREFIX) :].split(":", 1)
        depth = int(head) if head.isdigit() else 0
    return f"{REPLACEMENT_PREFIX}{depth + 1}:{root}"
