"""Route (Reserve), the coordinator's command: queued samples onto instances in one batch under
the run lock; a group's first routed member reserves a buffer entry (`rules.route_decision`)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection

from workers.wire.enums import RunState
from workers.wire.types import RouteOutcome

from .. import queries
from ..errors import InvalidInput, NotFound
from ..idempotency import transactional
from ..rules import BufferCounts, group_version, pins_group_version, route_decision
from ..types import RouteResult
from .core import (
    FAST_UNDONE,
    LockedRead,
    RunRow,
    RunTx,
    TxMixin,
    check_batch,
    check_state,
    lock_fast_or_run,
)
from .events import Event


class RoutingOps(TxMixin):
    @transactional
    def route(
        self,
        run_id: int,
        pairs: Sequence[tuple[int, int]],
        request_id: str | None = None,
        *,
        conn: Connection | None = None,
    ) -> list[RouteResult]:
        """Route queued samples to instances; the group's first member reserves a buffer entry."""
        check_batch(pairs, "routes")
        tokens = route_tokens(len(pairs))

        def routing(conn: Connection) -> list[RouteResult]:
            read = route_read(pairs)
            # a duplicate is refused under the run lock
            fast = len({p[0] for p in pairs}) == len(pairs)
            locked = lock_fast_or_run(
                conn, run_id, "route_groups_reserved", read, route_fast_reads(run_id, read), fast=fast
            )
            if locked.rtx is None:
                routed = route_fast(conn, pairs, tokens, read, *locked.fast)
                if routed is not None:
                    return routed
                # joins only after all: the group locks are freed before the run lock is awaited
                locked = lock_fast_or_run(conn, run_id, "route_groups_reserved", read, fast=False, prelude=FAST_UNDONE)
            assert locked.rtx is not None
            results = route_in(locked.rtx, pairs, tokens)
            locked.rtx.flush()
            return results

        results: list[RouteResult] = self.idempotent(
            request_id,
            "route",
            routing,
            lambda stored: [RouteResult(**{**r, "outcome": RouteOutcome(r["outcome"])}) for r in stored],
            body=[run_id, pairs],
            conn=conn,
        )
        return results


class RouteInstance(NamedTuple):
    """An instance of the batch as `route_read` reads it (FOR SHARE)."""

    id: int
    state: str
    version: int
    live: bool  # its lease has not run out


class RouteSample(NamedTuple):
    """A sample of the batch as `route_read` reads it (FOR UPDATE)."""

    id: int
    group_id: int
    state: str
    v_traj: int | None
    n_tokens: int
    last_version: int | None
    attempt: int


@dataclass
class RoutedGroup:
    """A group as a route batch changes it: its state, reserved buffer and live version."""

    state: str
    buffer: int | None
    version: int | None


Member = tuple[str, int | None, int]  # a live member: (state, V_traj, response tokens)


@dataclass
class RouteRows:
    """What `route_read` returned: the batch's instances and samples, their groups, and the
    live members of the reserved ones."""

    instances: dict[int, RouteInstance]
    samples: dict[int, RouteSample]
    groups: dict[int, RoutedGroup]
    members: dict[int, dict[int, Member]]


# Everything route reads, in ONE statement (`route_read` in rollout.sql), sent with the run
# lock (`lock_fast_or_run`; a coordinator cycle: `RunTx.open`): a round trip saved is time
# every other run-locked transaction waits less. The lock order stays run -> group locks -> instances -> samples -> groups, each in id order: the
# branches of a UNION ALL run one after the other, and the groups' CTE reads the samples' one.
# Instances FOR SHARE: an expiry or deregistration waits until this route commits, so its
# requeue then sees the samples routed here; one that committed first is seen as fenced.
# Locked rows are read at their latest version; the members of reserved groups (unlocked, read
# from the statement's snapshot, taken after the run lock was granted) are as current as they
# were when read in a statement of their own: reports change them without any lock we hold.
# The groups by `= ANY(ARRAY(...))`: an index lookup each, in id order; `IN (SELECT ...)` was
# planned as a hash join over a scan of every group of every run; likewise the members
# (uq_samples_group_id_idx, which leads with group_id), which by the join condition alone were
# read by a scan of every sample.


def route_read(pairs: Sequence[tuple[int, int]]) -> LockedRead:
    """The read, after the run lock and the groups' group locks (core.py, "group locks")."""
    return LockedRead(
        "route_read",
        {"instances": sorted({p[1] for p in pairs}), "samples": [p[0] for p in pairs]},
        locks=("group_locks",),
    )


def route_fast_reads(run_id: int, read: LockedRead) -> list[tuple[str, Any]]:
    """What the fast path reads under its group locks (`lock_fast_or_run`): the batch's rows
    (`route_fast_read`) and the run with its buffers (`run_buffers`)."""
    return [read.statement(run_id, "route_fast_read"), (queries.pyformat("run_buffers"), {"run": run_id})]


def route_fast(
    conn: Connection, pairs: Sequence[tuple[int, int]], tokens: Sequence[str], read: LockedRead, got: Any, run: Any
) -> list[RouteResult] | None:
    """Route the batch without the run lock if every queued sample of it joins a group already
    reserved, at a version no lower than that of any live member the group has (so the group's
    version, and with it every window a run-locked cascade or abort reads, stays what it was,
    whatever members such a transaction aborts meanwhile): it reserves nothing and writes no
    group row. `got`, `run`: `route_fast_reads`' results, under the groups' group locks, which
    serialize it with the other routes and rewards of its groups (core.py, "group locks").
    None: nothing done, the call needs the run lock."""
    if not got or run is None:
        return None  # a group not reserved after all (the guess raced), or no such run
    rtx = RunTx(conn, RunRow.of(run["run"]), [BufferCounts(i, o, r, c) for i, o, r, c in run["buffers"]])
    rtx.preset_read(read, got)
    if rtx.run.state != RunState.ACTIVE:
        return None
    rows = _route_rows(rtx, pairs, missing_ok=True)
    if rows is None or not _joins_only(rows, pairs):
        return None
    results = route_in(rtx, pairs, tokens, rows=rows, write_groups=False)
    assert not rtx.changed_buffers(), "a fast route changed buffer accounting"
    rtx.flush()  # the routed samples and their events; the savepoint ends with the transaction
    return results


def _joins_only(rows: RouteRows, pairs: Sequence[tuple[int, int]]) -> bool:
    """Every pair's group is reserved with a pinned version, and each queued sample routed to a
    live instance would run at a version >= every pinned version of its group's live members."""
    for sid, iid in pairs:
        sample, inst = rows.samples[sid], rows.instances[iid]
        g = rows.groups[sample.group_id]
        pinned = [v for st, v, n in rows.members.get(sample.group_id, {}).values() if pins_group_version(st, v, n)]
        if g.state != "reserved" or not pinned:
            return False
        if sample.state != "queued" or inst.state != "active" or not inst.live:
            continue  # refused either way, on the rows locked here
        v = sample.v_traj if sample.n_tokens > 0 and sample.v_traj is not None else inst.version
        if v < max(cast(int, x) for x in pinned):
            return False
    return True


def route_tokens(n: int) -> list[str]:
    """Secret route tokens for a route batch (uuid4: os.urandom, a strong random source), drawn
    before the run lock: 128 of them took about 1 ms, which every run-locked call waited."""
    return [str(uuid.uuid4()) for _ in range(n)]


def route_in(
    rtx: RunTx,
    pairs: Sequence[tuple[int, int]],
    tokens: Sequence[str] | None = None,
    *,
    rows: RouteRows | None = None,
    write_groups: bool = True,
) -> list[RouteResult]:
    """Route the batch; `tokens`: one route token per pair (`route_tokens`), else drawn here.
    `rows`: the batch's rows already read; `write_groups` False: the fast path, which changes
    no group row (`route_fast`)."""
    check_state(rtx.run, "routing", paused_ok=False)
    sample_ids = [p[0] for p in pairs]
    if len(set(sample_ids)) != len(sample_ids):
        raise InvalidInput("a sample appears twice in one route batch")
    if rows is None:
        rows = _route_rows(rtx, pairs)
        assert rows is not None
    results: list[RouteResult] = []
    routed: list[tuple[int, int, int]] = []  # (sample, V_traj, instance)
    touched: set[int] = set()
    for sid, iid in pairs:
        result = _route_one(rtx, rows, rows.samples[sid], rows.instances[iid])
        results.append(result)
        if result.outcome == RouteOutcome.ROUTED:
            assert result.v_traj is not None
            touched.add(rows.samples[sid].group_id)
            routed.append((sid, result.v_traj, iid))
    if routed:
        token = dict(zip(sample_ids, tokens if tokens is not None else route_tokens(len(pairs)), strict=True))
        _write_routes(rtx, rows, results, routed, touched if write_groups else set(), token)
    return results


def _route_rows(rtx: RunTx, pairs: Sequence[tuple[int, int]], missing_ok: bool = False) -> RouteRows | None:
    """The batch's rows from the read sent with the run lock; NotFound for one not in the run
    (None instead with `missing_ok`)."""
    rows = RouteRows({}, {}, {}, {})
    for kind, row in rtx.locked_read(route_read(pairs)):
        if kind == "i":
            rows.instances[row["id"]] = RouteInstance(**row)
        elif kind == "s":
            rows.samples[row["id"]] = RouteSample(**row)
        else:
            rows.groups.setdefault(row["id"], RoutedGroup(row["state"], row["reserved_buffer"], row["min_version"]))
            if row["mid"] is not None:
                rows.members.setdefault(row["id"], {})[row["mid"]] = (row["mstate"], row["mv"], row["mn"])
    for sid, iid in pairs:
        if sid not in rows.samples or iid not in rows.instances:
            if missing_ok:
                return None
        if sid not in rows.samples:
            raise NotFound(f"sample {sid} in run {rtx.run.id}")
        if iid not in rows.instances:
            raise NotFound(f"instance {iid} in run {rtx.run.id}")
    return rows


def _route_one(rtx: RunTx, rows: RouteRows, sample: RouteSample, inst: RouteInstance) -> RouteResult:
    """One pair of the batch, in order: its outcome, and if routed, its group's new state."""
    run = rtx.run
    gid = sample.group_id
    g = rows.groups[gid]
    if sample.state != "queued":
        return RouteResult(sample.id, RouteOutcome.NOT_QUEUED)
    if inst.state != "active" or not inst.live:  # a lapsed lease is fenced before any sweep
        return RouteResult(sample.id, RouteOutcome.INSTANCE_INACTIVE)
    if g.state not in ("queued", "reserved"):
        return RouteResult(sample.id, RouteOutcome.GROUP_CLOSED)
    # the group rows (locked above) carry the reservation: route moves none, so no need to
    # read all of the run's reservations inside the serial section
    reserved_at = g.buffer if g.state == "reserved" else None
    live = rows.members.setdefault(gid, {})
    outcome, v, b = route_decision(
        sample.n_tokens > 0,
        sample.v_traj,
        sample.last_version,
        inst.version,
        reserved_at,
        rtx.buffers,
        run.version,
        run.limits,
    )
    if outcome != RouteOutcome.ROUTED:
        return RouteResult(sample.id, RouteOutcome(outcome))
    assert v is not None
    live[sample.id] = ("running", v, sample.n_tokens)
    g.version = group_version(live.values())  # raised if this member was the oldest (version raise)
    if b is not None:
        g.state, g.buffer = "reserved", b
        rtx.add_reservation(gid, b, g.version)
        rtx.events.append(Event("group_reserved", group=gid, buffer=b, data={"version": v}))
    else:
        rtx.set_group_version(gid, g.version)
    return RouteResult(sample.id, RouteOutcome.ROUTED, None, v, g.buffer)


def _write_routes(
    rtx: RunTx,
    rows: RouteRows,
    results: list[RouteResult],
    routed: list[tuple[int, int, int]],
    touched: set[int],
    token: dict[int, str],
) -> None:
    """Written with the flush, not on round trips of their own. Every route gets a fresh secret
    route token (`route_tokens`) and counts the attempt from the row locked above, so the
    results need no RETURNING."""
    routes = {sid: (rows.samples[sid].attempt + 1, token[sid]) for sid, _, _ in routed}
    rtx.defer(
        "route_samples",
        {
            "ids": [r[0] for r in routed],
            "vs": [r[1] for r in routed],
            "is": [r[2] for r in routed],
            "as": [routes[r[0]][0] for r in routed],
            "ts": [routes[r[0]][1] for r in routed],
        },
    )
    tg = sorted(touched)
    if tg:
        rtx.defer(
            "route_groups",
            {"ids": tg, "bs": [rows.groups[g].buffer for g in tg], "mvs": [rows.groups[g].version for g in tg]},
            groups=tg,
        )
    for r in results:
        if r.outcome == RouteOutcome.ROUTED:
            r.attempt, r.route_token = routes[r.sample_id]
    rtx.events.extend(Event("sample_routed", sample=sid, instance=iid, data={"v": v}) for sid, v, iid in routed)
