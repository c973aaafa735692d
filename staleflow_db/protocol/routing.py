"""Route (Reserve): queued samples onto instances in one batch under the run lock; a group's
first routed member reserves a buffer entry (`rules.route_decision`)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from workers.wire.types import RouteOutcome

from ..errors import InvalidInput, NotFound
from ..rules import group_version, route_decision
from ..types import RouteResult
from .base import LockedRead, RunTx
from .events import Event


@dataclass
class RoutedGroup:
    """A group as a route batch changes it: its state, reserved buffer and live version."""

    state: str
    buffer: int | None
    version: int | None


# Everything route reads, in ONE statement (`route_read` in rollout.sql), sent with the run
# lock (`RunTx.open`): a round trip saved is time every other run-locked transaction waits
# less. The lock order stays run -> instances -> samples -> groups, each in id order: the
# branches of a UNION ALL run one after the other, and the groups' CTE reads the samples' one.
# Instances FOR SHARE: an expiry or deregistration waits until this route commits, so its
# requeue then sees the samples routed here; one that committed first is seen as fenced.
# Locked rows are read at their latest version; the members of reserved groups (unlocked, read
# from the statement's snapshot, taken after the run lock was granted) are as current as they
# were when read in a statement of their own: reports change them without any lock we hold.
# The groups by `= ANY(ARRAY(...))`: an index lookup each, in id order; `IN (SELECT ...)` was
# planned as a hash join over a scan of every group of every run; likewise the members
# (ix_samples_group), which by the join condition alone were read by a scan of every sample.


def route_read(pairs: Sequence[tuple[int, int]]) -> LockedRead:
    return LockedRead("route_read", {"instances": sorted({p[1] for p in pairs}), "samples": [p[0] for p in pairs]})


def route_tokens(n: int) -> list[str]:
    """Secret route tokens for a route batch (uuid4: os.urandom, a strong random source), drawn
    before the run lock: 128 of them took about 1 ms, which every run-locked call waited."""
    return [str(uuid.uuid4()) for _ in range(n)]


def route_in(rtx: RunTx, pairs: Sequence[tuple[int, int]], tokens: Sequence[str] | None = None) -> list[RouteResult]:
    """Route the batch; `tokens`: one route token per pair (`route_tokens`), else drawn here."""
    run = rtx.run
    sample_ids = [p[0] for p in pairs]
    if len(set(sample_ids)) != len(sample_ids):
        raise InvalidInput("a sample appears twice in one route batch")
    instances: dict[int, Any] = {}
    samples: dict[int, Any] = {}
    groups: dict[int, RoutedGroup] = {}
    members: dict[int, dict[int, tuple[str, int | None, int]]] = {}
    for kind, row in rtx.locked_read(route_read(pairs)):
        if kind == "i":
            instances[row["id"]] = SimpleNamespace(**row)
        elif kind == "s":
            samples[row["id"]] = SimpleNamespace(**row)
        else:
            groups.setdefault(row["id"], RoutedGroup(row["state"], row["reserved_buffer"], row["min_version"]))
            if row["mid"] is not None:
                members.setdefault(row["id"], {})[row["mid"]] = (row["mstate"], row["mv"], row["mn"])
    for sid, iid in pairs:
        if sid not in samples:
            raise NotFound(f"sample {sid} in run {run.id}")
        if iid not in instances:
            raise NotFound(f"instance {iid} in run {run.id}")
    results, routed, touched = [], [], set()
    for sid, iid in pairs:
        sample, inst = samples[sid], instances[iid]
        gid = sample.group_id
        g = groups[gid]
        if sample.state != "queued":
            results.append(RouteResult(sid, RouteOutcome.NOT_QUEUED))
            continue
        if inst.state != "active" or not inst.live:  # a lapsed lease is fenced before any sweep
            results.append(RouteResult(sid, RouteOutcome.INSTANCE_INACTIVE))
            continue
        if g.state not in ("queued", "reserved"):
            results.append(RouteResult(sid, RouteOutcome.GROUP_CLOSED))
            continue
        # the group rows (locked above) carry the reservation: route moves none, so no need to
        # read all of the run's reservations inside the serial section
        reserved_at = g.buffer if g.state == "reserved" else None
        live = members.setdefault(gid, {})
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
            results.append(RouteResult(sid, RouteOutcome(outcome)))
            continue
        live[sid] = ("running", v, sample.n_tokens)
        g.version = group_version(live.values())  # raised if this member was the oldest (version raise)
        if b is not None:
            g.state, g.buffer = "reserved", b
            rtx.add_reservation(gid, b, g.version)
            rtx.events.append(Event("group_reserved", group=gid, buffer=b, data={"version": v}))
        else:
            rtx.set_group_version(gid, g.version)
        touched.add(gid)
        routed.append((sid, v, iid))
        results.append(RouteResult(sid, RouteOutcome.ROUTED, None, v, g.buffer))
    if routed:
        # Written with the flush, not on round trips of their own. Every route gets a fresh
        # secret route token (`route_tokens`) and counts the attempt from the row locked above,
        # so the results need no RETURNING.
        token = dict(zip(sample_ids, tokens if tokens is not None else route_tokens(len(pairs)), strict=True))
        routes = {sid: (samples[sid].attempt + 1, token[sid]) for sid, _, _ in routed}
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
        rtx.defer(
            "route_groups",
            {"ids": tg, "bs": [groups[g].buffer for g in tg], "mvs": [groups[g].version for g in tg]},
            groups=tg,
        )
        for r in results:
            if r.outcome == RouteOutcome.ROUTED:
                r.attempt, r.route_token = routes[r.sample_id]
        rtx.events.extend(Event("sample_routed", sample=sid, instance=iid, data={"v": v}) for sid, v, iid in routed)
    return results
