"""Node sync: the calls of several instances one process hosts (a GPU node) in ONE transaction,
through the per-instance operations themselves (`RolloutOps.report`, `.heartbeat`,
`.poll_work`). Each instance keeps its own lease and fences: an instance's item that is refused
(a Conflict: its lease lapsed, a route lost) is rolled back alone and reported as its outcome,
the others apply. Any other refusal (bad input, an unknown sample) refuses the whole call,
naming the item: nothing is applied.

Savepoints cost two round trips each and refusals are rare: the items run first under one
savepoint for them all; only when one is refused does that roll back and the items run again,
each under its own (as `staleflow_db.group_commit` does for a group)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from .. import queries
from ..errors import Conflict, ProtocolError
from ..types import Report
from .core import TxMixin
from .rollout import Poll, RolloutOps


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


class _Refused(Exception):
    """An item refused in the run without savepoints: the items run again, each in its own."""


class NodeOps(RolloutOps, TxMixin):
    def sync_node(self, run_id: int, items: Sequence[NodeItem], *, conn: Connection) -> list[NodeOutcome]:
        """Apply `items` (distinct instances) in the caller's transaction `conn`; outcomes in
        their order. Lock order: by instance id, as a group commit's (instances -> samples)."""
        order = sorted(range(len(items)), key=lambda i: items[i].instance_id)
        outer = conn.begin_nested()
        try:
            outcomes = self._sync_items(run_id, items, order, conn, savepoints=False)
        except _Refused:
            outer.rollback()
            outer = conn.begin_nested()
            outcomes = self._sync_items(run_id, items, order, conn, savepoints=True)
        except BaseException:
            if outer.is_active:
                outer.rollback()
            raise
        outer.commit()
        if any(o.refused is None and items[k].reports for k, o in enumerate(outcomes)) and any(
            o.refused is None and items[k].heartbeat for k, o in enumerate(outcomes)
        ):
            # a heartbeat's SET LOCAL synchronous_commit=off must not make the reports' commit asynchronous
            conn.execute(queries.text("group_commit_durable"))
        return outcomes

    def _sync_items(
        self, run_id: int, items: Sequence[NodeItem], order: list[int], conn: Connection, savepoints: bool
    ) -> list[NodeOutcome]:
        outcomes = [NodeOutcome(it.instance_id) for it in items]
        for k in order:
            it = items[k]
            sp = conn.begin_nested() if savepoints else None
            try:
                if it.reports:
                    outcomes[k].applied = self.report(run_id, it.reports, snapshot=it.snapshot, conn=conn)
                if it.heartbeat is not None:
                    hb = it.heartbeat
                    self.heartbeat(it.instance_id, hb.version, dict(hb.snapshot), hb.lease_seconds, conn=conn)
            except Conflict as e:
                if sp is None:
                    raise _Refused() from e
                sp.rollback()
                outcomes[k] = NodeOutcome(it.instance_id, 0, list(e.items), e.code, str(e))
            except ProtocolError as e:  # the caller's mistake: the whole call is refused, naming the item
                e.args = (f"items.{k} (instance {it.instance_id}): {e}",)
                raise
            else:
                if sp is not None:
                    sp.commit()
        return outcomes

    def poll_node(self, instance_ids: Sequence[int], limit: int = 1000, *, conn: Connection) -> list[NodeDelivery]:
        """`poll_work` for each instance in the caller's transaction; a fenced one (refused by
        its statement before it changes anything) gets its Conflict as its delivery."""
        out = []
        for iid in sorted(instance_ids):
            try:
                out.append(NodeDelivery(iid, self.poll_work(iid, limit, conn=conn)))
            except Conflict as e:
                out.append(NodeDelivery(iid, Poll(), list(e.items), e.code, str(e)))
        by_id = {d.instance_id: d for d in out}
        return [by_id[i] for i in instance_ids]
