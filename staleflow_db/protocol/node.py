"""Node sync: the calls of several instances one process hosts (a GPU node) in ONE transaction.
Each instance keeps its own lease and fences: an instance's item that is refused (a Conflict:
its lease lapsed, a route lost) is rolled back alone and reported as its outcome, the others
apply. Any other refusal (bad input, an unknown sample) refuses the whole call, naming the
item: nothing is applied.

Refusals are rare, so the items are first folded into set-based statements, under one
savepoint (`_folded`): every item's instance (its report's lease renewal and snapshot, its
heartbeat) in one statement, every reported sample's lock in the same round trip, each item's
reports checked as a report checks them, and all the segments written in one statement. When
any item would be refused, or anything is out of the ordinary (a sample in two items), that is
rolled back and the items run again through the per-instance operations themselves
(`RolloutOps.report`, `.heartbeat`), each under its own savepoint: every item then gets exactly
the outcome it gets alone. The folded path applies only what that path would apply, leaving
the same rows (its events in fewer rows of the log: one per kind, not one per kind and item):
tests/db/test_node_fold.py runs both on the same items and compares. Lock order, either way:
instances by id, each before its samples.

Polls: `poll_node` delivers to every instance what `poll_work` delivers to each, with two
statements in one round trip (`node_poll`, `node_commands`); `poll_node_idle` is what
`poll_idle` is to `poll_work`: one read, in autocommit, that says a node poll would answer
empty."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from .. import queries
from ..errors import Conflict, NotFound, ProtocolError
from ..idempotency import transactional
from ..types import Report
from . import driver
from .core import MAX_BATCH, TxMixin, check_live
from .rollout import (
    Command,
    Poll,
    RolloutOps,
    check_reports,
    keep_capacity,
    lock_running_params,
    reporting_instances,
    reports_write,
    works_of,
)


@dataclass(frozen=True)
class NodeHeartbeat:
    version: int
    snapshot: Mapping[str, Any]
    lease_seconds: float


@dataclass(frozen=True)
class NodeItem:
    """One instance's calls: its report (`snapshot` riding along) and/or a heartbeat, after it."""

    instance_id: int
    reports: Sequence[Report] = ()
    snapshot: Mapping[str, Any] | None = None
    heartbeat: NodeHeartbeat | None = None


@dataclass
class NodeOutcome:
    """An item's outcome: segments applied, or the Conflict's items (nothing of it applied)."""

    instance_id: int
    applied: int = 0
    refused: list[tuple[int, str]] | None = None
    code: str | None = None
    message: str | None = None


@dataclass
class NodeDelivery:
    """One instance's poll: what it delivered, or why the instance is fenced."""

    instance_id: int
    poll: Poll = field(default_factory=Poll)
    refused: list[tuple[int, str]] | None = None
    code: str | None = None
    message: str | None = None


# The folded path's savepoint, sent in its pipelines (no round trip of its own): released with
# the write, or rolled back (and released) when the items must run one by one.
_SAVEPOINT = "staleflow_node"
_BEGIN: tuple[str, dict[str, Any]] = (f"SAVEPOINT {_SAVEPOINT}", {})
_KEEP: tuple[str, dict[str, Any]] = (f"RELEASE SAVEPOINT {_SAVEPOINT}", {})
_UNDO: list[tuple[str, dict[str, Any]]] = [(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}", {}), _KEEP]


class NodeOps(RolloutOps, TxMixin):
    def sync_node(self, run_id: int, items: Sequence[NodeItem], *, conn: Connection) -> list[NodeOutcome]:
        """Apply `items` (distinct instances) in the caller's transaction `conn`; outcomes in
        their order. Lock order: instances by id, each before its samples."""
        if not items:
            return []
        folded = self._folded(run_id, items, conn)
        if folded is not None:
            return folded
        outer = conn.begin_nested()
        try:
            outcomes = self._sync_items(run_id, items, conn)
            applied = [items[k] for k, o in enumerate(outcomes) if o.refused is None]
            if any(it.reports for it in applied) and any(it.heartbeat for it in applied):
                # a heartbeat's SET LOCAL synchronous_commit=off must not make the reports' commit asynchronous
                conn.execute(queries.text("group_commit_durable"))
        except BaseException:
            if outer.is_active:
                outer.rollback()
            raise
        outer.commit()
        return outcomes

    def _folded(self, run_id: int, items: Sequence[NodeItem], conn: Connection) -> list[NodeOutcome] | None:
        """Every item applied by set-based statements in two round trips, or None, nothing of
        them kept, when an item would be refused or the items do not fit them (then they run
        one by one, which gives each its own outcome)."""
        order = sorted(items, key=lambda it: it.instance_id)
        reports = [r for it in order for r in it.reports]
        ids = [r.sample_id for r in reports]
        if (
            len({it.instance_id for it in items}) != len(items)
            or len(set(ids)) != len(ids)  # a sample in two items: the second sees what the first did
            or any(r.instance_id != it.instance_id for it in items for r in it.reports)
            or any(len(it.reports) > MAX_BATCH for it in items)
        ):
            return None
        p = [
            {
                "i": it.instance_id,
                "r": bool(it.reports),
                "s": None if it.snapshot is None or not it.reports else keep_capacity(it.snapshot),
                "v": None if it.heartbeat is None else it.heartbeat.version,
                "h": None if it.heartbeat is None else keep_capacity(it.heartbeat.snapshot),
                "t": None if it.heartbeat is None else it.heartbeat.lease_seconds,
            }
            for it in order
            if it.reports or it.heartbeat is not None  # an item of neither does nothing
        ]
        statements = [
            _BEGIN,
            (queries.pyformat("node_instances"), {"run": run_id, "p": json.dumps(p), "eph": not reports}),
        ]
        if reports:  # the samples after the instances (lock order), in the same round trip
            statements.append((queries.pyformat("report_lock_running"), lock_running_params(run_id, reports)))
        got = driver.rows(conn, statements)
        run_and_instances = got[1]
        beat = {r.iid for r in run_and_instances if r.beat}
        if any(it.heartbeat is not None and it.instance_id not in beat for it in items) or not self._checked(
            run_id, order, run_and_instances, got[2] if reports else [], len(ids)
        ):
            driver.rows(conn, _UNDO)
            return None
        if reports:
            statement, params = reports_write(run_id, reports, {r.id: r for r in got[2]})
            driver.rows(conn, [(queries.composed_pyformat(statement), params), _KEEP])
        else:
            driver.rows(conn, [_KEEP])
        return [NodeOutcome(it.instance_id, len(it.reports)) for it in items]

    @staticmethod
    def _checked(
        run_id: int, order: Sequence[NodeItem], run_and_instances: Sequence[Any], running: Sequence[Any], n: int
    ) -> bool:
        """Whether every item's reports pass the checks of its own report (`reporting_instances`,
        `check_reports`) on the rows read for them all. A sample that is not running (or not
        found) refuses its report: not worth reading it here."""
        if len(running) != n:
            return False
        rows = {r.id: r for r in running}
        try:
            for it in order:
                if it.reports:
                    run, quoted_tokens, fenced = reporting_instances(run_id, it.reports, run_and_instances)
                    check_reports(run, it.reports, rows, quoted_tokens, fenced)
        except ProtocolError:  # a Conflict or bad input
            return False
        return True

    def _sync_items(self, run_id: int, items: Sequence[NodeItem], conn: Connection) -> list[NodeOutcome]:
        """The items one by one, in instance id order, each under its own savepoint."""
        outcomes = [NodeOutcome(it.instance_id) for it in items]
        for k in sorted(range(len(items)), key=lambda i: items[i].instance_id):
            it = items[k]
            sp = conn.begin_nested()
            try:
                if it.reports:
                    outcomes[k].applied = self.report(run_id, it.reports, snapshot=it.snapshot, conn=conn)
                if it.heartbeat is not None:
                    hb = it.heartbeat
                    self.heartbeat(it.instance_id, hb.version, dict(hb.snapshot), hb.lease_seconds, conn=conn)
            except Conflict as e:
                sp.rollback()
                outcomes[k] = NodeOutcome(it.instance_id, 0, list(e.items), e.code, str(e))
            except ProtocolError as e:  # the caller's mistake: the whole call is refused, naming the item
                sp.rollback()
                e.args = (f"items.{k} (instance {it.instance_id}): {e}",)
                raise
            else:
                sp.commit()
        return outcomes

    @transactional
    def poll_node_idle(
        self, instance_ids: Sequence[int], request_id: str | None = None, *, conn: Connection | None = None
    ) -> bool:
        """True when a node poll of `instance_ids` (sent with `request_id`) would now answer
        only empty deliveries: `poll_idle` true for every instance (nothing to deliver, no
        lease renewal due, nothing to refuse: a fenced instance gets its 409, an unknown one
        refuses the call) and no outcome stored under the request id. One read, no lock and no
        write, as `poll_idle`; a node poll a concurrent duplicate is delivering is not idle for
        the same reason (its work and commands stay undelivered in any snapshot until its
        delivery and stored outcome commit together)."""
        with self.statement_tx(conn) as conn:
            params = {"ids": list(instance_ids), "k": request_id}
            return bool(conn.execute(queries.text("node_poll_idle"), params).scalar())

    def poll_node(self, instance_ids: Sequence[int], limit: int = 1000, *, conn: Connection) -> list[NodeDelivery]:
        """`poll_work` for every instance at once, in the caller's transaction: the instances,
        their samples and their commands in two statements, one round trip (`node_poll`,
        `node_commands`); `limit` per instance. A fenced instance (refused before anything of
        it changed) gets its Conflict as its delivery; an unknown one refuses the call."""
        ids = sorted(instance_ids)
        params = {"ids": ids, "n": limit}
        rows, cmds = driver.rows(conn, [(queries.pyformat(q), params) for q in ("node_poll", "node_commands")])
        by_instance: dict[int, list[Any]] = {}
        for r in rows:
            by_instance.setdefault(r.iid, []).append(r)
        commands: dict[int, list[Command]] = {}
        for c in cmds:
            commands.setdefault(c.instance_id, []).append(
                Command(c.id, c.kind, c.sample_id, c.attempt, c.target_version)
            )
        out = {}
        for iid in ids:
            mine = by_instance.get(iid)
            if not mine:
                raise NotFound(f"instance {iid}")
            try:
                check_live(iid, mine[0].state, mine[0].live)
            except Conflict as e:
                out[iid] = NodeDelivery(iid, Poll(), list(e.items), e.code, str(e))
                continue
            out[iid] = NodeDelivery(iid, Poll(works_of(mine), sorted(commands.get(iid, []), key=lambda c: c.id)))
        return [out[i] for i in instance_ids]
