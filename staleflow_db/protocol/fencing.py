"""Fencing of instance-scoped operations: an instance is live only while active with an
unexpired lease, and a segment report applies only from the instance holding the sample's
route (its attempt and secret route token)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from sqlalchemy import Connection

from workers.wire.enums import SegmentKind

from .. import queries
from ..errors import Conflict, InvalidInput, NotFound, TooLarge
from ..types import Report
from .base import RunRow
from .events import Event, events_params


def check_live(instance_id: int, state: str, live: bool) -> None:
    """A fenced instance (not active, or its lease lapsed) is refused: it must register again."""
    if state != "active":
        raise Conflict([(instance_id, f"instance is {state}; register again")])
    if not live:
        raise Conflict([(instance_id, "instance lease expired; register again")])


def report_in(conn: Connection, run_id: int, reports: Sequence[Report]) -> int:
    # The run and the reporting instances in one round trip. The instances FOR SHARE in id order
    # (lock order instances -> samples, as route and expiry): each must stay active with a live
    # lease until this report commits. A run with no such instance still gives its one row.
    run_and_instances = conn.execute(
        queries.text("report_run_and_instances"),
        {"run": run_id, "ids": sorted({r.instance_id for r in reports})},
    ).all()
    if not run_and_instances:
        raise NotFound(f"run {run_id}")
    run = RunRow.of(run_and_instances[0]._mapping)
    ids = [r.sample_id for r in reports]
    if len(set(ids)) != len(ids):
        raise InvalidInput("a sample appears twice in one report batch")
    quoted = {}
    for r in reports:
        r.check_shape()
        if r.kind not in tuple(SegmentKind):
            raise InvalidInput(f"sample {r.sample_id}: unknown kind {r.kind!r}")
        quoted[r.sample_id] = r.route_token_uuid()
    fenced = {}
    found = [r for r in run_and_instances if r.iid is not None]
    for inst in found:
        try:
            check_live(inst.iid, inst.istate, inst.live)
        except Conflict as e:
            fenced[inst.iid] = e.items[0][1]
    unknown = sorted({r.instance_id for r in reports} - {r.iid for r in found})
    if unknown:
        raise NotFound(f"instance {unknown[0]} in run {run_id}")
    # Lock only the running rows: those are all a report can change. A stale report naming a
    # sample that moved on (scoring, aborted ...) must not wait on its lock: with the run-locked
    # record_rewards, which holds scoring rows and then locks their groups' members, that
    # wait closed a deadlock cycle. The rest are read unlocked, only to refuse them.
    rows = {r.id: r for r in conn.execute(queries.text("report_lock_running"), {"run": run_id, "ids": ids}).all()}
    missing = [i for i in ids if i not in rows]
    if missing:
        rows.update(
            (r.id, r) for r in conn.execute(queries.text("report_read_others"), {"run": run_id, "ids": missing}).all()
        )
    conflicts = []
    for r in reports:
        s = rows.get(r.sample_id)
        if s is None:
            raise NotFound(f"sample {r.sample_id} in run {run_id}")
        why = fenced.get(r.instance_id) or route_lost(
            r, s.state, s.attempt, s.instance_id, s.route_token, quoted[r.sample_id]
        )
        if why:
            conflicts.append((r.sample_id, why))
            continue
        floor = s.last_version if s.last_version is not None else s.v_traj
        if not floor <= r.version <= run.version:
            raise InvalidInput(f"sample {r.sample_id}: segment version {r.version} outside {floor}..{run.version}")
        if s.n_tokens + len(r.tokens) > run.max_response_tokens:
            raise TooLarge(f"sample {r.sample_id}: response over {run.max_response_tokens} tokens")
    if conflicts:
        raise Conflict(conflicts)
    # Segments, sample counters and events in ONE statement (three tables, disjoint rows):
    # one round trip instead of three. Composed (`queries.with_parts`): a batch with no tokens
    # or no events has no such part.
    state_of = {SegmentKind.FINISHED: "finished", SegmentKind.INTERRUPTED: "queued", SegmentKind.PARTIAL: "running"}
    events = [
        Event(
            f"sample_{SegmentKind(r.kind).value}",
            sample=r.sample_id,
            instance=r.instance_id,
            data={"n": len(r.tokens), "v": r.version},
        )
        for r in reports
        if r.kind != SegmentKind.PARTIAL
    ]
    ctes = []
    params: dict[str, object] = {
        "run": run_id,
        "ids": ids,
        "ns": [len(r.tokens) for r in reports],
        "vs": [r.version for r in reports],
        "sts": [state_of[SegmentKind(r.kind)] for r in reports],
        "fs": [r.finish_reason for r in reports],
    }
    segs = [r for r in reports if r.tokens]
    if segs:
        ctes.append(queries.sql("report_segments"))
        params["p"] = json.dumps(
            [
                {
                    "s": r.sample_id,
                    "q": rows[r.sample_id].n_segments,
                    "v": r.version,
                    "i": r.instance_id,
                    "a": r.attempt,
                    "t": r.tokens,
                    "l": r.logprobs,
                    "f": r.finish_reason,
                }
                for r in segs
            ]
        )
    if events:
        ctes.append(queries.prefixed("events_insert", "e_"))
        params.update(events_params(run_id, events, "e_"))
    conn.execute(queries.composed(queries.with_parts(ctes, queries.sql("report_samples"))), params)
    return len(reports)


def route_lost(r: Report, state: str, attempt: int, instance: int | None, token, quoted) -> str | None:
    """Why a report does not hold the sample's route (None when it does)."""
    if state != "running":
        return f"route lost: sample is {state}"
    if instance != r.instance_id:
        return f"route lost: sample is not routed to instance {r.instance_id}"
    if attempt != r.attempt or token != quoted:
        return "route lost: stale attempt or route token"
    return None
