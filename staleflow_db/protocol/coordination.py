"""Coordinator side: leadership by an expiring lease row, the per-cycle snapshot (one short
read-only transaction) and the per-cycle commands (one write transaction, fenced by the
leader's epoch so a deposed leader cannot clobber state)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any, NamedTuple

from sqlalchemy import Connection, text

from .. import notify
from ..errors import Conflict, InvalidInput, NotFound
from ..idempotency import transactional
from ..types import RouteResult
from .base import RUN_COLUMNS, RunRow, RunTx, TxMixin, load_run
from .rollout import INTERRUPT_COMMANDS, INTERRUPT_TARGETS, check_batch, check_found, check_unique, interrupt_running
from .routing import route_in, route_read


class RunningSample(NamedTuple):
    sample_id: int
    tokens: int  # response tokens reported
    prompt_tokens: int
    v_traj: int


class BufferView(NamedTuple):
    occupied: int
    reserved: int


@dataclass
class InstanceView:
    id: int
    name: str
    version: int
    snapshot: dict[str, Any]
    snapshot_age_s: float | None
    running: list[RunningSample]


@dataclass
class QueuedView:
    sample_id: int
    group_id: int
    v_traj: int | None  # None: fresh, takes the version of the instance it is routed to
    last_version: int | None
    length: int  # prompt + response tokens so far
    tokens: int  # response tokens so far
    group_state: str
    group_buffer: int | None  # the group's reserved buffer (join rule), if any
    group_min_version: int | None  # least V_traj of its routed members (its queue level)
    last_instance: int | None  # where its latest segment was generated (policies that resume in place)


@dataclass
class Snapshot:
    run_id: int
    version: int
    config: dict[str, int | bool]
    buffers: dict[int, BufferView]  # by index, unconsumed only
    instances: list[InstanceView]
    # the queued samples as decoded: arrays in QueuedView's field order (the coordinator builds
    # its own objects from them, and reuses those of rows unchanged since its last cycle)
    queued_rows: list[list[Any]]
    latest_params: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def queued(self) -> list[QueuedView]:
        return [QueuedView(*q) for q in self.queued_rows]


# The cycle's snapshot (`CoordinationOps.snapshot`): the run, its unconsumed buffers, its live
# instances, their running samples, the queued samples (oldest first, up to :n) and the latest
# published version, as one JSON array. Rows are arrays in the field order of the views they
# become. The instances' filter is read once (CTE i) for them and their running samples. A
# queued sample never routed (no V_traj: most of a queue) has no segments to look up.
SNAPSHOT = (
    f"WITH r AS MATERIALIZED (SELECT {RUN_COLUMNS} FROM runs WHERE id = :run),"
    " i AS MATERIALIZED (SELECT id, name, version, snapshot, extract(epoch FROM now() - snapshot_at)::float8 AS age"
    "   FROM instances WHERE run_id = :run AND state = 'active' AND lease_expires_at > now())"
    " SELECT json_build_array("
    "  (SELECT to_json(r) FROM r),"
    "  (SELECT json_agg(json_build_array(b.idx, b.occupied, b.reserved) ORDER BY b.idx)"
    "    FROM buffers b JOIN r ON b.run_id = r.id AND b.idx >= r.version),"
    "  (SELECT json_agg(json_build_array(i.id, i.name, i.version, i.snapshot, i.age) ORDER BY i.id) FROM i),"
    "  (SELECT json_agg(json_build_array(s.instance_id, s.id, s.n_tokens, cardinality(g.prompt_tokens), s.v_traj)"
    "     ORDER BY s.id)"
    "    FROM i JOIN samples s ON s.instance_id = i.id AND s.state = 'running'"
    "    JOIN prompt_groups g ON g.id = s.group_id),"
    "  (SELECT json_agg(json_build_array(q.id, q.group_id, q.v_traj, q.last_version, q.length, q.n_tokens, q.gstate,"
    "     q.reserved_buffer, q.min_version,"
    "     CASE WHEN q.v_traj IS NOT NULL THEN"
    "      (SELECT x.instance_id FROM segments x WHERE x.sample_id = q.id ORDER BY x.seq DESC LIMIT 1) END)"
    "     ORDER BY q.id)"
    "    FROM (SELECT s.id, s.group_id, s.v_traj, s.last_version, cardinality(g.prompt_tokens) + s.n_tokens AS length,"
    "      s.n_tokens, g.state::text AS gstate, g.reserved_buffer, g.min_version"
    "      FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
    "      WHERE s.run_id = :run AND s.state = 'queued' ORDER BY s.id LIMIT :n) q),"
    "  (SELECT max(version) FROM param_versions WHERE run_id = :run))"
)


# Pulls as WITH-clause parts, here and in `cycle_without_routes`: a command `t` per (instance
# :is, target version :vs) for the run's active instances, and its event `e`, written only
# where `{gate}` holds.
PULL_COMMANDS = (
    "t AS (INSERT INTO commands (run_id, instance_id, kind, target_version, epoch)"
    "   SELECT :run, u.i, 'pull', u.v, :epoch FROM unnest(CAST(:is AS bigint[]), CAST(:vs AS int[]))"
    "   WITH ORDINALITY AS u(i, v, o)"
    "   JOIN instances x ON x.id = u.i AND x.run_id = :run AND x.state = 'active' WHERE {gate} ORDER BY u.o"
    "   RETURNING id, instance_id, target_version),"
    " e AS (INSERT INTO events (run_id, kind, instance_id, data)"
    "   SELECT :run, 'pull', t.instance_id, jsonb_build_object('target', t.target_version) FROM t ORDER BY t.id"
    "   RETURNING id)"
)


# A cycle without routes (most cycles; every one whose commands are only interrupts and pulls)
# is ONE statement, sent in autocommit: one round trip from the decision to the commit, where
# BEGIN, the interrupts, the pulls, the fenced cycle row and COMMIT were three to five. It has
# only the parts the cycle needs (an empty cycle: the fence and its row). Nothing is written
# unless `ok`: the lease `l` is ours and live (held FOR SHARE to the statement's end, so no
# takeover commits in between) and every sample to interrupt is in the run; the caller then
# raises what the transaction raised. write_ms is the server's time from the statement's start
# to the cycle row, taken after the commands and events are written (the CASE counts them first).
@cache
def cycle_without_routes(interrupts: bool, pulls: bool) -> str:
    gate = "EXISTS (SELECT FROM ok)"
    parts = [
        "l AS MATERIALIZED (SELECT run_id, epoch FROM coordinator_leases WHERE run_id = :run AND holder = :h"
        " AND epoch = :epoch AND expires_at > now() FOR SHARE)"
    ]
    written = ["0"]
    if interrupts:
        parts += [INTERRUPT_TARGETS, "ok AS MATERIALIZED (SELECT FROM l WHERE (SELECT count(*) FROM f) = :n_ids)"]
        parts.append(INTERRUPT_COMMANDS.format(gate=gate))
        written.append("(SELECT count(*) FROM c)")
    else:
        parts.append("ok AS MATERIALIZED (SELECT FROM l)")
    if pulls:
        parts.append(PULL_COMMANDS.format(gate=gate))
        written.append("(SELECT count(*) FROM e)")
    parts.append(
        "y AS (INSERT INTO coordinator_cycles (run_id, epoch, snapshot_ms, decide_ms, write_ms, routed, interrupted,"
        f" pulled, migrated) SELECT l.run_id, l.epoch, :s, :d, CASE WHEN {' + '.join(written)} >= 0"
        " THEN extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000 END, 0, :i, :p, :m FROM l, ok)"
    )
    found = "ARRAY(SELECT id FROM f)" if interrupts else "CAST(ARRAY[] AS bigint[])"
    return f"WITH {', '.join(parts)} SELECT EXISTS (SELECT FROM l) AS fenced, {found} AS found"


class CoordinationOps(TxMixin):
    @transactional
    def acquire_leadership(
        self, run_id: int, holder: str, ttl_seconds: float = 5.0, *, conn: Connection | None = None
    ) -> int | None:
        """Become (or stay) the run's coordinator: returns the leadership epoch, or None while
        another holder's lease is live. Taking over bumps the epoch, fencing the old leader."""
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            row = conn.execute(
                text(
                    "INSERT INTO coordinator_leases AS l (run_id, holder, epoch, expires_at)"
                    " VALUES (:run, :h, 1, now() + make_interval(secs => :ttl))"
                    " ON CONFLICT (run_id) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at,"
                    "   epoch = CASE WHEN l.holder = excluded.holder THEN l.epoch ELSE l.epoch + 1 END"
                    " WHERE l.holder = excluded.holder OR l.expires_at <= now()"
                    " RETURNING epoch"
                ),
                {"run": run_id, "h": holder, "ttl": ttl_seconds},
            ).first()
            return None if row is None else row.epoch

    @transactional
    def release_leadership(self, run_id: int, holder: str, *, conn: Connection | None = None) -> None:
        with self.tx(conn) as conn:
            conn.execute(
                text("UPDATE coordinator_leases SET expires_at = now() WHERE run_id = :run AND holder = :h"),
                {"run": run_id, "h": holder},
            )

    @transactional
    def check_epoch(
        self, run_id: int, epoch: int | None, holder: str | None = None, *, conn: Connection | None = None
    ) -> None:
        """Refuse (409) a write from a deposed coordinator; `epoch` None checks nothing. With
        `conn`, the lease stays held (FOR SHARE) until the caller's transaction commits."""
        if epoch is None:
            return
        with self.tx(conn) as conn:
            check_epoch(conn, run_id, epoch, holder)

    @transactional
    def pull(
        self,
        run_id: int,
        instance_ids: Sequence[int],
        target_version: int | None = None,
        epoch: int | None = None,
        *,
        conn: Connection | None = None,
    ) -> int:
        """Tell the run's active instances among `instance_ids` to load newer weights
        (`target_version`, default the run's version); returns how many were told."""
        check_unique(instance_ids, "instance", "pull")
        with self.tx(conn) as conn:
            run = load_run(conn, run_id, lock=False)
            target = run.version if target_version is None else target_version
            if target > run.version:
                raise InvalidInput(f"target_version {target} is newer than the run's version {run.version}")
            ids = sorted(set(instance_ids))
            known = conn.execute(
                text("SELECT id FROM instances WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))"),
                {"run": run_id, "ids": ids},
            ).scalars()
            missing = set(ids) - set(known)
            if missing:
                raise NotFound(f"instance {min(missing)} in run {run_id}")
            return len(queue_pulls(conn, run_id, [(i, target) for i in ids], epoch))

    def notify_work(self, run_id: int, instance_ids: Sequence[int]) -> None:
        """Wake the API's long-polls of these instances (on every replica) after a commit made
        outside the API: one NOTIFY, in its own statement, never inside a protocol transaction
        (NOTIFY takes a global lock at commit). Without it they notice on their polling timer.
        Autocommit: the statement is its own transaction, one round trip (BEGIN, SELECT,
        COMMIT were three, between the commands' commit and their delivery)."""
        wakeup = notify.Wakeup.of(notify.OUTSIDE, run_id, map(notify.instance_topic, instance_ids))
        with self.engine.connect() as conn:
            notify.send(conn.execution_options(isolation_level="AUTOCOMMIT"), [wakeup])

    def snapshot(self, run_id: int, max_queued: int = 20_000) -> Snapshot:
        """Everything a coordinator cycle decides on, from one consistent view: ONE statement
        (one snapshot of the database, as a REPEATABLE READ transaction gave) sent in
        autocommit, so a cycle reads the cluster in one round trip (it took nine: BEGIN, SET,
        six reads, COMMIT), with the rows as one JSON document (decoded in C, not per row)."""
        with self.engine.connect() as conn:
            got = (
                conn.execution_options(isolation_level="AUTOCOMMIT")
                .execute(text(SNAPSHOT), {"run": run_id, "n": max_queued})
                .scalar_one()
            )
        if got[0] is None:
            raise NotFound(f"run {run_id}")
        run = RunRow.of(got[0])
        running: dict[int, list[RunningSample]] = {}
        for iid, *r in got[3] or ():
            running.setdefault(iid, []).append(RunningSample(*r))
        return Snapshot(
            run_id,
            run.version,
            run.config(),
            {idx: BufferView(o, r) for idx, o, r in got[1] or ()},
            [InstanceView(i, n, v, snap or {}, age, running.get(i, [])) for i, n, v, snap, age in got[2] or ()],
            got[4] or [],
            got[5],
        )

    @transactional
    def apply_commands(
        self,
        run_id: int,
        holder: str,
        epoch: int,
        routes: Sequence[tuple[int, int]] = (),
        interrupts: Sequence[int] = (),
        pulls: Sequence[tuple[int, int]] = (),
        cycle: dict[str, float] | None = None,  # snapshot_ms, decide_ms, migrated; write_ms is timed here
        *,
        conn: Connection | None = None,
    ) -> list[RouteResult]:
        """One cycle's routes, interrupts and pulls in one transaction, only from the leader.

        Round trips are decision delay (every command waits for this commit): the run lock is
        taken only for routes (interrupts and pulls move no buffer, as in `interrupt` and
        `pull`), with the routes' locking read in its round trip, and with `cycle` the fence
        goes with the cycle's row as the last statement. A fence checked last is as good as
        first: the lease row is then held FOR SHARE until the commit, and a takeover that
        committed before it fails the check, so the whole transaction rolls back. A cycle
        without routes is one statement (`cycle_without_routes`), fenced the same way."""
        check_batch(routes, "routes")
        if cycle is not None and not routes and conn is None:
            self._cycle_without_routes(run_id, holder, epoch, interrupts, pulls, cycle)
            return []

        with self.tx(conn) as conn:
            started = time.monotonic()
            if cycle is None:
                check_epoch(conn, run_id, epoch, holder)
            results: list[RouteResult] = []
            if routes:
                rtx = RunTx.open(conn, run_id, route_read(routes))
                results = route_in(rtx, routes)
                rtx.flush()  # route's writes are deferred to the flush: interrupts must see them
            if interrupts:
                interrupt_running(conn, run_id, interrupts, epoch)
            if pulls:
                queue_pulls(conn, run_id, pulls, epoch)
            if cycle is not None:
                # the cycle's write time: every statement of this transaction but this one and the commit
                fenced = conn.execute(
                    text(
                        "INSERT INTO coordinator_cycles (run_id, epoch, snapshot_ms, decide_ms, write_ms, routed,"
                        " interrupted, pulled, migrated) SELECT l.run_id, l.epoch, :s, :d, :w, :r, :i, :p, :m"
                        " FROM coordinator_leases l WHERE l.run_id = :run AND l.holder = :h AND l.epoch = :e"
                        " AND l.expires_at > now() FOR SHARE"
                    ),
                    {
                        "run": run_id,
                        "h": holder,
                        "e": epoch,
                        "s": cycle.get("snapshot_ms", 0.0),
                        "d": cycle.get("decide_ms", 0.0),
                        "w": (time.monotonic() - started) * 1000,
                        "r": sum(r.outcome == "routed" for r in results),
                        "i": len(interrupts),
                        "p": len(pulls),
                        "m": int(cycle.get("migrated", 0)),
                    },
                ).rowcount
                if not fenced:
                    check_epoch(conn, run_id, epoch, holder)  # raises Conflict with the reason
                    raise Conflict([(epoch, "not the coordinator of this run (leadership lost or expired)")])
            return results

    def _cycle_without_routes(
        self,
        run_id: int,
        holder: str,
        epoch: int,
        interrupts: Sequence[int],
        pulls: Sequence[tuple[int, int]],
        cycle: dict[str, float],
    ) -> None:
        with self.engine.connect() as conn:
            got = (
                conn.execution_options(isolation_level="AUTOCOMMIT")
                .execute(
                    text(cycle_without_routes(bool(interrupts), bool(pulls))),
                    {
                        "run": run_id,
                        "h": holder,
                        "epoch": epoch,
                        "ids": list(interrupts),
                        "n_ids": len(set(interrupts)),
                        **pull_params(pulls),
                        "s": cycle.get("snapshot_ms", 0.0),
                        "d": cycle.get("decide_ms", 0.0),
                        "i": len(interrupts),
                        "p": len(pulls),
                        "m": int(cycle.get("migrated", 0)),
                    },
                )
                .one()
            )
            check_found(run_id, interrupts, set(got.found))
            if not got.fenced:
                check_epoch(conn, run_id, epoch, holder)  # raises Conflict with the reason
                raise Conflict([(epoch, "not the coordinator of this run (leadership lost or expired)")])


def check_epoch(conn: Connection, run_id: int, epoch: int, holder: str | None = None) -> None:
    """The coordinator fence (ENGINEERING pattern 9): `epoch` (and `holder`, when given) must be
    the run's live lease. FOR SHARE holds off a takeover until this transaction commits."""
    lease = conn.execute(
        text("SELECT holder, epoch FROM coordinator_leases WHERE run_id = :run AND expires_at > now() FOR SHARE"),
        {"run": run_id},
    ).first()
    current = None if lease is None else lease.epoch
    if holder is not None and (lease is None or lease.holder != holder or current != epoch):
        raise Conflict([(epoch, "not the coordinator of this run (leadership lost or expired)")])
    if current != epoch:
        raise Conflict([(epoch, f"coordinator epoch {epoch} is not the run's current lease ({current})")])


def queue_pulls(conn: Connection, run_id: int, pulls: Sequence[tuple[int, int]], epoch: int | None) -> list[int]:
    """Queue a pull command per (instance, target version) for those instances that are active
    in the run; returns them."""
    # the commands and their events in one statement (one round trip of decision delay)
    told = conn.execute(
        text(f"WITH {PULL_COMMANDS.format(gate='true')} SELECT instance_id FROM t ORDER BY id"),
        {"run": run_id, "epoch": epoch, **pull_params(pulls)},
    ).scalars()
    return list(told)


def pull_params(pulls: Sequence[tuple[int, int]]) -> dict[str, list[int]]:
    return {"is": [p[0] for p in pulls], "vs": [p[1] for p in pulls]}
