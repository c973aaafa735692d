"""Route (Reserve): queued samples onto instances in one batch under the run lock; a group's
first routed member reserves a buffer entry (`rules.route_decision`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import text

from ..errors import InvalidInput, NotFound
from ..rules import group_version, route_decision
from ..types import RouteOutcome, RouteResult
from .base import RunTx
from .events import Event


@dataclass
class RoutedGroup:
    """A group as a route batch changes it: its state, reserved buffer and live version."""

    state: str
    buffer: int | None
    version: int | None


def route_in(rtx: RunTx, pairs: Sequence[tuple[int, int]]) -> list[RouteResult]:
    conn, run = rtx.conn, rtx.run
    sample_ids = [p[0] for p in pairs]
    if len(set(sample_ids)) != len(sample_ids):
        raise InvalidInput("a sample appears twice in one route batch")
    # Instances first (lock order instances -> samples, as expiry and reports take them), FOR
    # SHARE in id order: an expiry or deregistration waits until this route commits, so its
    # requeue then sees the samples routed here; one that committed first is seen as fenced.
    instances = {
        r.id: r
        for r in conn.execute(
            text(
                "SELECT id, state, version, lease_expires_at > now() AS live FROM instances"
                " WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[])) ORDER BY id FOR SHARE"
            ),
            {"run": run.id, "ids": sorted({p[1] for p in pairs})},
        ).all()
    }
    samples = {
        r.id: r
        for r in conn.execute(
            text(
                "SELECT s.id, s.group_id, s.state, s.v_traj, s.n_tokens, s.last_version FROM samples s"
                " WHERE s.run_id = :run AND s.id = ANY(CAST(:ids AS bigint[])) ORDER BY s.id FOR UPDATE"
            ),
            {"run": run.id, "ids": sample_ids},
        ).all()
    }
    for sid, iid in pairs:
        if sid not in samples:
            raise NotFound(f"sample {sid} in run {run.id}")
        if iid not in instances:
            raise NotFound(f"instance {iid} in run {run.id}")
    # The groups (locked) with their live members in one statement: the group version after
    # the route (min_version). The members' snapshot may predate a wait for a group lock;
    # what they say is as current as before, when they were read in a statement of their own
    # right after it (reports change members without any group or run lock either way).
    groups: dict[int, RoutedGroup] = {}
    members: dict[int, dict[int, tuple[str, int | None, int]]] = {}
    for gr in conn.execute(
        text(
            "WITH g AS MATERIALIZED (SELECT id, state::text AS state, reserved_buffer, min_version FROM prompt_groups"
            "   WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id FOR UPDATE)"
            " SELECT g.id, g.state, g.reserved_buffer, g.min_version, m.id AS mid, m.state::text AS mstate,"
            "  m.v_traj, m.n_tokens FROM g LEFT JOIN samples m ON g.state = 'reserved' AND m.group_id = g.id"
            "   AND m.state <> 'aborted' AND m.v_traj IS NOT NULL"
        ),
        {"ids": list({s.group_id for s in samples.values()})},
    ).all():
        groups.setdefault(gr.id, RoutedGroup(gr.state, gr.reserved_buffer, gr.min_version))
        if gr.mid is not None:
            members.setdefault(gr.id, {})[gr.mid] = (gr.mstate, gr.v_traj, gr.n_tokens)
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
        # every route draws a fresh secret lease token (gen_random_uuid: a strong random source)
        # samples and their groups in one statement (distinct tables: the two updates share
        # a snapshot and touch disjoint rows)
        tg = sorted(touched)
        leases = {
            sid: (att, lease)
            for sid, att, lease in conn.execute(
                text(
                    "WITH w AS (UPDATE prompt_groups g SET state = 'reserved', reserved_buffer = u.b, min_version = u.mv"
                    "   FROM unnest(CAST(:gids AS bigint[]), CAST(:bs AS int[]), CAST(:mvs AS int[])) AS u(id, b, mv)"
                    "   WHERE g.id = u.id)"
                    " UPDATE samples s SET state = 'running', v_traj = u.v, instance_id = u.i, attempt = s.attempt + 1,"
                    " lease = gen_random_uuid(), delivered = false, updated_at = now()"
                    " FROM unnest(CAST(:ids AS bigint[]), CAST(:vs AS int[]), CAST(:is AS bigint[])) AS u(id, v, i)"
                    " WHERE s.id = u.id RETURNING s.id, s.attempt, s.lease::text"
                ),
                {
                    "ids": [r[0] for r in routed],
                    "vs": [r[1] for r in routed],
                    "is": [r[2] for r in routed],
                    "gids": tg,
                    "bs": [groups[g].buffer for g in tg],
                    "mvs": [groups[g].version for g in tg],
                },
            ).all()
        }
        for r in results:
            if r.outcome == RouteOutcome.ROUTED:
                r.attempt, r.lease = leases[r.sample_id]
        rtx.events.extend(Event("sample_routed", sample=sid, instance=iid, data={"v": v}) for sid, v, iid in routed)
    return results
