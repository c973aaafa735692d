"""Coordinator side: leadership by an expiring leader epoch (table leader_epochs), the per-cycle snapshot (one short
read-only transaction) and the commands: interrupts, pulls, and a cycle's routes (`routing`),
interrupts and pulls in one write transaction, fenced by the leader's epoch so a deposed
leader cannot clobber state. The coordinator's other commands are the drops (`aborts`)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from sqlalchemy import Connection
from sqlalchemy.exc import DataError

from .. import notify, queries
from ..errors import Conflict, InvalidInput, NotFound
from ..idempotency import transactional
from ..types import RouteResult, RunConfig
from .core import RunRow, RunTx, TxMixin, check_batch, check_epoch, check_found, check_unique, load_run
from .routing import route_in, route_read

# a read's position: PostgreSQL's pg_snapshot as text (xmin:xmax:in-progress xids)
SNAPSHOT_POSITION = re.compile(r"\d{1,20}:\d{1,20}:(\d{1,20}(,\d{1,20})*)?")


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
    config: RunConfig
    buffers: dict[int, BufferView]  # by index, unconsumed only
    instances: list[InstanceView]
    # the queued samples as decoded: arrays in QueuedView's field order (the coordinator builds
    # its own objects from them, and reuses those of rows unchanged since its last cycle)
    queued_rows: list[Sequence[Any]]  # lists, or tuples from a SnapshotMirror
    latest_params: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    state: str = "active"  # the run's lifecycle state: a coordinator routes only an active run

    @cached_property
    def queued(self) -> list[QueuedView]:
        return [QueuedView(*q) for q in self.queued_rows]


class CoordinationOps(TxMixin):
    @transactional
    def acquire_leadership(
        self, run_id: int, holder: str, ttl_seconds: float = 5.0, *, conn: Connection | None = None
    ) -> int | None:
        """Become (or stay) the run's coordinator: returns the leadership epoch, or None while
        another holder's leader epoch is live. Taking over bumps the epoch, fencing the old leader."""
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            row = conn.execute(
                queries.text("acquire_leadership"),
                {"run": run_id, "h": holder, "ttl": ttl_seconds},
            ).first()
            return None if row is None else row.epoch

    @transactional
    def release_leadership(self, run_id: int, holder: str, *, conn: Connection | None = None) -> None:
        with self.tx(conn) as conn:
            conn.execute(queries.text("release_leadership"), {"run": run_id, "h": holder})

    @transactional
    def check_epoch(
        self, run_id: int, epoch: int | None, holder: str | None = None, *, conn: Connection | None = None
    ) -> None:
        """Refuse (409) a write from a deposed coordinator; `epoch` None checks nothing. With
        `conn`, the leader epoch's row stays held (FOR SHARE) until the caller's transaction commits."""
        if epoch is None:
            return
        with self.tx(conn) as conn:
            check_epoch(conn, run_id, epoch, holder)

    @transactional
    def interrupt(
        self, run_id: int, sample_ids: Sequence[int], epoch: int | None = None, *, conn: Connection | None = None
    ) -> int:
        """Ask the instances running these samples to interrupt them (they report what they
        have); returns how many were running. `epoch`: the coordinator's, kept on the commands."""
        check_unique(sample_ids, "sample", "interrupt")
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            return interrupt_running(conn, run_id, sample_ids, epoch)

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
            known = conn.execute(queries.text("instances_in_run"), {"run": run_id, "ids": ids}).scalars()
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
        six reads, COMMIT), with the rows as one JSON document (decoded in C, not per row).
        Its cost grows with the samples in flight: a coordinator reads `snapshot_changes`."""
        with self.engine.connect() as conn:
            got = (
                conn.execution_options(isolation_level="AUTOCOMMIT")
                .execute(queries.text("snapshot"), {"run": run_id, "n": max_queued})
                .scalar_one()
            )
        return snapshot_of(run_id, got)

    def snapshot_changes(self, run_id: int, since: str | None = None) -> list[Any]:
        """The snapshot as changes since `since` (the `position` of the caller's previous read),
        or whole when `since` is None or too old: one autocommit statement, its cost following
        what changed, not what is in flight. A document of `workers.wire.snapshot_mirror.FIELDS`;
        `SnapshotMirror` merges them, and `snapshot_of(run_id, mirror.view())` is then what
        `snapshot` returns (docs/coordinator.md, "Snapshot changes"). `since` is a pg_snapshot
        as text (xmin:xmax:xip,...): anything else is InvalidInput."""
        if since is not None and not SNAPSHOT_POSITION.fullmatch(since):
            raise InvalidInput(f"since {since[:40]!r} is not a snapshot position (xmin:xmax:xip,...)")
        try:
            with self.engine.connect() as conn:
                got: list[Any] = (
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                    .execute(queries.text("snapshot_changes"), {"run": run_id, "since": since})
                    .scalar_one()
                )
        except DataError as exc:  # well formed, but no snapshot (xmin > xmax, out of range)
            raise InvalidInput(f"since {since!r} is not a snapshot position (xmin:xmax:xip,...)") from exc
        if got[2] is None:
            raise NotFound(f"run {run_id}")
        return got

    @transactional
    def prune_snapshot_changes(self, run_id: int, keep_s: float = 60.0, *, conn: Connection | None = None) -> None:
        """Forget the run's snapshot changes older than `keep_s` seconds; a later read from
        before them is answered whole."""
        with self.tx(conn) as conn:
            conn.execute(queries.text("prune_snapshot_changes"), {"run": run_id, "keep_s": keep_s})

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
        first: the leader epoch's row is then held FOR SHARE until the commit, and a takeover that
        committed before it fails the check, so the whole transaction rolls back. A cycle
        without routes is one autocommit statement (`cycle` in coordination.sql), fenced the same way."""
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
                    queries.text("cycle_row"),
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
                    queries.text("cycle"),
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


def snapshot_of(run_id: int, got: Sequence[Any]) -> Snapshot:
    """A snapshot from its rows: [run, buffers, instances, running, queued, latest published
    version], as the `snapshot` statement returns them (and `SnapshotMirror.view`)."""
    if got[0] is None:
        raise NotFound(f"run {run_id}")
    run = RunRow.of(got[0])
    running: dict[int, list[RunningSample]] = {}
    for iid, *r in got[3] or ():
        running.setdefault(iid, []).append(RunningSample(*r))
    return Snapshot(
        run_id,
        run.version,
        run.config,
        {idx: BufferView(o, r) for idx, o, r in got[1] or ()},
        [InstanceView(i, n, v, snap or {}, age, running.get(i, [])) for i, n, v, snap, age in got[2] or ()],
        got[4] or [],
        got[5],
        state=run.state,
    )


def interrupt_running(conn: Connection, run_id: int, sample_ids: Sequence[int], epoch: int | None) -> int:
    """Queue interrupt commands for those of the samples that are running; returns how many.
    A sample that is not in the run (unknown, or another run's) is NotFound, as everywhere."""
    # One statement reads the samples and queues the commands (a decision-delay round trip
    # less for the coordinator); one not found rolls the whole transaction back.
    rows = conn.execute(
        queries.text("interrupt_running"),
        {"run": run_id, "ids": list(sample_ids), "epoch": epoch},
    ).all()
    check_found(run_id, sample_ids, {r.id for r in rows})
    return sum(r.running for r in rows)


def queue_pulls(conn: Connection, run_id: int, pulls: Sequence[tuple[int, int]], epoch: int | None) -> list[int]:
    """Queue a pull command per (instance, target version) for those instances that are active
    in the run; returns them."""
    # the commands and their events in one statement (one round trip of decision delay)
    told = conn.execute(
        queries.text("queue_pulls"),
        {"run": run_id, "epoch": epoch, **pull_params(pulls)},
    ).scalars()
    return list(told)


def pull_params(pulls: Sequence[tuple[int, int]]) -> dict[str, list[int]]:
    return {"is": [p[0] for p in pulls], "vs": [p[1] for p in pulls]}
