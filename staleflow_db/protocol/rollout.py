"""Rollout side of the protocol: instances and their leases (register, heartbeat, deregister,
the expiry sweep), work delivery (poll) and segment reports, each fenced by the instance's
lease and, for a report, by the route's attempt and secret route token. A poll or a report
renews the instance's live lease by its `lease_s` in the same statement: a busy instance needs
no heartbeat to keep it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Row

from workers.wire.enums import SegmentKind

from .. import payloads, queries
from ..errors import Conflict, InvalidInput, NotFound, TooLarge
from ..idempotency import transactional
from ..types import Report
from . import driver
from .core import RunRow, TxMixin, check_batch, check_live, check_state, load_run, route_lost
from .events import Event, events_params, log_events


@dataclass
class Work:
    """A routed sample as its instance receives it: continue after `prefix_tokens`."""

    sample_id: int
    attempt: int
    route_token: str  # secret token of this route: every report on it must quote it
    group_id: int
    v_traj: int
    prompt_tokens: list[int]
    prefix_tokens: list[int]
    prefix_logprobs: list[float]
    max_new_tokens: int
    # per prefix token: 1 generated, 0 an environment observation's (multi-turn); empty prefix: []
    prefix_mask: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # the prompt's (an environment's reset reads it)


@dataclass
class Command:
    id: int
    kind: str
    sample_id: int | None
    attempt: int | None
    target_version: int | None


@dataclass
class Poll:
    """What one poll delivers to its instance: the one shape of a poll reply, each part empty
    when there is none of it (an empty poll is `Poll()`); the API's PollOut has these fields."""

    work: list[Work] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)


class RolloutOps(TxMixin):
    # ---- instances -------------------------------------------------------------------------

    @transactional
    def register_instance(
        self,
        run_id: int,
        name: str,
        version: int,
        lease_seconds: float = 30.0,
        token_id: int | None = None,
        *,
        capacity: Mapping[str, int] | None = None,
        conn: Connection | None = None,
    ) -> int:
        """A new instance id per process start; a restarted worker never inherits a lease.
        `token_id`: the API token registering it (the API lets only that token act for it).
        `capacity`: the engine's `max_running` and `kv_capacity` (workers.wire's `Capacity`),
        kept in the snapshot until a heartbeat reports another; None: not reported."""
        with self.tx(conn) as conn:
            run = load_run(conn, run_id, lock=False)
            check_state(run, "registering an instance")
            if not 0 <= version <= run.version:
                raise InvalidInput(f"instance version {version} outside 0..{run.version}")
            iid: int = conn.execute(
                queries.text("register_instance"),
                {
                    "run": run_id,
                    "name": name,
                    "v": version,
                    "ttl": lease_seconds,
                    "tok": token_id,
                    "snap": json.dumps({} if capacity is None else {"capacity": dict(capacity)}),
                },
            ).scalar_one()
            log_events(
                conn, run_id, [Event("instance_registered", instance=iid, data={"name": name, "version": version})]
            )
            return iid

    @transactional
    def heartbeat(
        self,
        instance_id: int,
        version: int,
        snapshot: dict[str, Any] | None = None,
        lease_seconds: float = 30.0,
        *,
        conn: Connection | None = None,
    ) -> None:
        """Extend a live lease and store the latest snapshot. Ephemeral: no synchronous commit.
        A snapshot whose `capacity` is missing or None keeps the capacity last reported.

        Every condition sits in the UPDATE itself, re-checked on the row it finally locks: two
        overlapping heartbeats can never move the version backwards (a plain read before the
        update could be stale by then) nor revive a lease that lapsed meanwhile. So it is one
        statement, its own transaction when the caller gives none (`statement_tx`)."""
        with self.statement_tx(conn) as conn:
            updated = conn.execute(
                queries.text("heartbeat"),
                {"i": instance_id, "v": version, "snap": json.dumps(keep_capacity(snapshot)), "ttl": lease_seconds},
            ).first()
            if updated is not None:
                return
            row = conn.execute(queries.text("heartbeat_refused"), {"i": instance_id}).first()
            if row is None:
                raise NotFound(f"instance {instance_id}")
            check_live(instance_id, row.state, row.live)
            raise InvalidInput(f"instance version {version} outside {row.version}..{row.run_version}")

    @transactional
    def expire_instances(self, run_id: int, *, conn: Connection | None = None) -> list[int]:
        """Tidy up after lapsed leases: mark those instances expired, and requeue every sample
        still running on any instance that is not active.

        The lease itself is enforced by time in every instance-scoped operation (route, poll,
        report, heartbeat): a lapsed instance is refused before this sweep runs. The sweep only
        gives its samples back to the queue, and also those of any instance fenced earlier
        (a straggler a concurrent route left behind must not stay running forever)."""
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            ids = conn.execute(queries.text("expire_instances"), {"run": run_id}).scalars().all()
            log_events(conn, run_id, [Event("instance_expired", instance=i) for i in sorted(ids)])
            requeue_fenced(conn, run_id, "instance_expired")
            return sorted(ids)

    @transactional
    def deregister_instance(self, instance_id: int, *, conn: Connection | None = None) -> list[int]:
        """A clean shutdown: the instance's running samples go back to the queue at once."""
        with self.tx(conn) as conn:
            row = conn.execute(queries.text("deregister_instance"), {"i": instance_id}).first()
            if row is None:
                if conn.execute(queries.text("instance_exists"), {"i": instance_id}).first() is None:
                    raise NotFound(f"instance {instance_id}")
                return []
            log_events(conn, row.run_id, [Event("instance_deregistered", instance=instance_id)])
            return requeue_fenced(conn, row.run_id, "instance_deregistered", [instance_id])

    # ---- segments --------------------------------------------------------------------------

    @transactional
    def report(
        self,
        run_id: int,
        reports: Sequence[Report],
        request_id: str | None = None,
        *,
        snapshot: Mapping[str, Any] | None = None,
        conn: Connection | None = None,
    ) -> int:
        """Append segments, each fenced by its reporting instance (routed to it, lease live),
        attempt and route token; all or nothing. Returns the number applied. The report renews
        its instances' live leases; `snapshot` (as a heartbeat's) is stored on them with it."""
        check_batch(reports, "reports")
        body: list[Any] = [run_id, reports] if snapshot is None else [run_id, reports, dict(snapshot)]
        applied: int = self.idempotent(
            request_id, "report", lambda c: report_in(c, run_id, reports, snapshot), int, body=body, conn=conn
        )
        return applied

    @transactional
    def poll_idle(self, instance_id: int, request_id: str | None = None, *, conn: Connection | None = None) -> bool:
        """True when a poll of the instance (sent with `request_id`) would now only answer
        empty: nothing to deliver, no lease renewal due, nothing to refuse (an unknown or fenced
        instance is not idle: its poll raises), no outcome stored under the request id. One
        read, no lock and no write: a long-poll's re-checks run it in autocommit, one round trip
        instead of a transaction (`idempotency.once`'s `idle`). A poll a concurrent duplicate is
        delivering is not idle: its undelivered work and pending commands are still seen until
        that delivery and its stored outcome commit, and the poll then waits and replays."""
        with self.statement_tx(conn) as conn:
            idle = conn.execute(queries.text("poll_idle"), {"i": instance_id, "k": request_id}).scalar()
            return bool(idle)

    @transactional
    def poll_work(self, instance_id: int, limit: int = 1000, *, conn: Connection | None = None) -> Poll:
        """Deliver newly routed samples (with any prefix to continue from) and pending commands;
        renews the instance's live lease."""
        with self.tx(conn) as conn:
            # One statement renews or checks the instance and delivers. Locked (renewed or FOR
            # SHARE): the instance stays active and live until this delivery commits (an expiry
            # waits for it, then requeues what was delivered). Its check is a one-time filter on the samples' scan, so it is
            # locked before any sample (lock order instances -> samples) and a fenced instance
            # gets nothing. One row per delivered sample, or one with no sample at all; none
            # when there is no such instance.
            # The commands in the same round trip, as a statement of its own (`deliver_commands`).
            params = {"i": instance_id, "n": limit}
            rows, cmds = driver.rows(conn, [(queries.pyformat(q), params) for q in ("poll_work", "deliver_commands")])
            if not rows:
                raise NotFound(f"instance {instance_id}")
            check_live(instance_id, rows[0].state, rows[0].live)
            return Poll(works_of(rows), sorted((Command(*c) for c in cmds), key=lambda c: c.id))


def works_of(rows: Sequence[Any]) -> list[Work]:
    """The work one instance's poll delivered, from its rows of `poll_work` (or `node_poll`):
    each row a delivered sample, with the response so far (none: a row with no sample)."""
    return [
        Work(
            w.id,
            w.attempt,
            w.route_token,
            w.group_id,
            w.v_traj,
            list(w.prompt_tokens),
            payloads.unpack_tokens(w.tokens),
            payloads.unpack_logprobs(w.logprobs),
            w.max_response_tokens - w.n_tokens,
            payloads.per_token(w.lengths, [int(g) for g in w.generated or ()]),
            w.meta or {},
        )
        for w in rows
        if w.id is not None
    ]


def keep_capacity(snapshot: Mapping[str, Any] | None) -> dict[str, Any]:
    """The snapshot as stored: a `capacity` of None is left out, so the stored one stays
    (the heartbeat statement keeps the capacity a snapshot does not carry)."""
    return {k: v for k, v in (snapshot or {}).items() if not (k == "capacity" and v is None)}


def requeue_fenced(conn: Connection, run_id: int, why: str, instance_ids: Sequence[int] | None = None) -> list[int]:
    """Samples running on fenced (non-active) instances of the run, or only on `instance_ids`
    (already fenced in this transaction), return to the queue with the tokens they reported."""
    rows = conn.execute(
        queries.text("requeue_fenced" if instance_ids is None else "requeue_instances"),
        {"run": run_id, "ids": list(instance_ids or [])},
    ).all()
    log_events(
        conn, run_id, [Event("sample_requeued", sample=s, instance=i, data={"why": why}) for s, i in sorted(rows)]
    )
    return sorted(s for s, _ in rows)


# ---- segment reports ---------------------------------------------------------------------
#
# `report_in` reads, checks and writes a batch; a node sync (protocol/node.py) reads its items'
# instances and samples in statements of its own, then checks each item's reports with the same
# `reporting_instances` and `check_reports` and writes them all with one `reports_write`.


def report_in(
    conn: Connection, run_id: int, reports: Sequence[Report], snapshot: Mapping[str, Any] | None = None
) -> int:
    """Apply a report batch (`RolloutOps.report`): all or nothing. The instances' statement and
    the running samples' lock go in one round trip (a pipeline: one after the other, so the
    lock order instances -> samples holds); the checks then read both."""
    ids = [r.sample_id for r in reports]
    instances = (
        queries.pyformat("report_run_and_instances"),
        {
            "run": run_id,
            "ids": sorted({r.instance_id for r in reports}),
            "snap": None if snapshot is None else json.dumps(keep_capacity(snapshot)),
        },
    )
    run_and_instances, running = driver.rows(
        conn, [instances, (queries.pyformat("report_lock_running"), lock_running_params(run_id, reports))]
    )
    run, quoted_tokens, fenced = reporting_instances(run_id, reports, run_and_instances)
    rows = _reported_samples(conn, run_id, ids, running)
    check_reports(run, reports, rows, quoted_tokens, fenced)
    _write_reports(conn, run_id, reports, rows)
    return len(reports)


def lock_running_params(run_id: int, reports: Sequence[Report]) -> dict[str, Any]:
    """`report_lock_running`'s parameters: the batch's samples, and those whose report is an
    observation (only they need to know whether their last segment was one)."""
    return {
        "run": run_id,
        "ids": [r.sample_id for r in reports],
        "obs": sorted(r.sample_id for r in reports if not r.generated),
    }


def reporting_instances(
    run_id: int, reports: Sequence[Report], run_and_instances: Sequence[Any]
) -> tuple[RunRow, dict[int, uuid.UUID], dict[int, str]]:
    """The run, the route token each report quotes (by sample; the batch checked: shape, kind,
    token syntax) and why each fenced reporting instance is fenced, from the rows of
    `report_run_and_instances`: the instances locked (renewed or FOR SHARE) before any sample
    (lock order instances -> samples, as route and expiry): each must stay active with a live
    lease until this report commits. A run with no such instance still gives its one row."""
    if not run_and_instances:
        raise NotFound(f"run {run_id}")
    run = RunRow.of(run_and_instances[0]._asdict())
    ids = [r.sample_id for r in reports]
    if len(set(ids)) != len(ids):
        raise InvalidInput("a sample appears twice in one report batch")
    quoted_tokens = {}
    for r in reports:
        r.check_shape()
        if r.kind not in tuple(SegmentKind):
            raise InvalidInput(f"sample {r.sample_id}: unknown kind {r.kind!r}")
        quoted_tokens[r.sample_id] = r.route_token_uuid()
    fenced: dict[int, str] = {}
    found = [r for r in run_and_instances if r.iid is not None]
    for inst in found:
        try:
            check_live(inst.iid, inst.istate, inst.live)
        except Conflict as e:
            fenced[inst.iid] = e.items[0][1]
    unknown = sorted({r.instance_id for r in reports} - {r.iid for r in found})
    if unknown:
        raise NotFound(f"instance {unknown[0]} in run {run_id}")
    return run, quoted_tokens, fenced


def _reported_samples(conn: Connection, run_id: int, ids: list[int], running: Sequence[Any]) -> dict[int, Any]:
    """The batch's samples by id, `running` (`report_lock_running`'s rows) and the others. Lock
    only the running rows: those are all a report can change.
    A stale report naming a sample that moved on (scoring, aborted ...) must not wait on its
    lock: with the run-locked record_rewards, which holds scoring rows and then locks their
    groups' members, that wait closed a deadlock cycle. The rest are read unlocked, only to
    refuse them."""
    rows: dict[int, Any] = {r.id: r for r in running}
    missing = [i for i in ids if i not in rows]
    if missing:
        rows.update(
            (r.id, r) for r in conn.execute(queries.text("report_read_others"), {"run": run_id, "ids": missing}).all()
        )
    return rows


def check_reports(
    run: RunRow,
    reports: Sequence[Report],
    rows: dict[int, Any],
    quoted_tokens: dict[int, uuid.UUID],
    fenced: dict[int, str],
) -> None:
    """Each report holds its sample's route (else a Conflict for all of them) and stays in the
    run's version range and response limit."""
    conflicts = []
    for r in reports:
        s = rows.get(r.sample_id)
        if s is None:
            raise NotFound(f"sample {r.sample_id} in run {run.id}")
        why = fenced.get(r.instance_id) or route_lost(
            r, s.state, s.attempt, s.instance_id, s.route_token, quoted_tokens[r.sample_id]
        )
        if why:
            conflicts.append((r.sample_id, why))
            continue
        if not r.generated:
            if s.last_generated is False:
                raise InvalidInput(f"sample {r.sample_id}: one observation per turn (the last segment is one)")
        else:
            floor = s.last_version if s.last_version is not None else s.v_traj
            assert r.version is not None  # check_shape
            if not floor <= r.version <= run.version:
                raise InvalidInput(f"sample {r.sample_id}: segment version {r.version} outside {floor}..{run.version}")
        if s.n_tokens + len(r.tokens) > run.max_response_tokens:
            raise TooLarge(f"sample {r.sample_id}: response over {run.max_response_tokens} tokens")
    if conflicts:
        raise Conflict(conflicts)


_STATE_AFTER = {SegmentKind.FINISHED: "finished", SegmentKind.INTERRUPTED: "queued", SegmentKind.PARTIAL: "running"}


def _write_reports(conn: Connection, run_id: int, reports: Sequence[Report], rows: dict[int, Row[Any]]) -> None:
    """Segments, sample counters and events in ONE statement (three tables, disjoint rows): one
    round trip instead of three."""
    statement, params = reports_write(run_id, reports, rows)
    conn.execute(queries.composed(statement), params)


def reports_write(run_id: int, reports: Sequence[Report], rows: dict[int, Row[Any]]) -> tuple[str, dict[str, Any]]:
    """`_write_reports`' statement (`:name` parameters) and its parameters, for a caller that
    sends it with others in one round trip (a node sync). Composed (`queries.with_parts`): a
    batch with no tokens or no events has no such part."""
    events = [
        Event(
            # an observation ending a turn sends the trajectory back to the queue: not an interrupt
            f"sample_{SegmentKind(r.kind).value}" if r.generated else "sample_observed",
            sample=r.sample_id,
            instance=r.instance_id,
            data={"n": len(r.tokens), "v": r.version, "generated": r.generated},
        )
        for r in reports
        if r.kind != SegmentKind.PARTIAL
    ]
    ctes = []
    params: dict[str, object] = {
        "run": run_id,
        "ids": [r.sample_id for r in reports],
        "ns": [len(r.tokens) for r in reports],
        "vs": [r.version for r in reports],
        "sts": [_STATE_AFTER[SegmentKind(r.kind)] for r in reports],
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
                    "n": len(r.tokens),
                    "f": r.finish_reason,
                    "g": r.generated,
                }
                for r in segs
            ]
        )
        params["pt"] = [payloads.pack_tokens(r.tokens) for r in segs]
        params["pl"] = [payloads.pack_logprobs(r.stored_logprobs()) for r in segs]
    if events:
        ctes.append(queries.prefixed("events_insert", "e_"))
        params.update(events_params(run_id, events, "e_"))
    return queries.with_parts(ctes, queries.sql("report_samples")), params
