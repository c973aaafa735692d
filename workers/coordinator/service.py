"""The coordinator service (`staleflow coordinator --run RUN`).

Each cycle: one read-only statement for what changed since the last cycle's (the snapshot's
changes, merged into a `SnapshotMirror`: a read that follows what changed, not what is in
flight; whole on the first cycle of a leadership), the pure strategy functions on
the speculative state, one write transaction for the commands (fenced by the leadership
epoch). One active coordinator per run by an expiring leader epoch; a standby polls the leader epoch
and takes over when the leader stops renewing it. The speculative state is rebuilt from the
database whenever leadership is (re)gained, so a restart loses nothing.

A database outage stops nothing: the cycle is retried with capped backoff until the database
is back (one log line when it goes, one when it returns), and leadership and the speculative
state are then re-established from the database, exactly as after a restart.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from staleflow_db.errors import Conflict
from staleflow_db.protocol import Protocol, Snapshot, snapshot_of
from staleflow_db.retry import DATABASE_OUTAGE, is_db_unavailable
from staleflow_db.rules import BufferCounts
from workers.retry import Outage
from workers.wire.snapshot_mirror import SnapshotMirror

from .admission import AdmissionView
from .cost_model import CostModel
from .cycle import Applied, run_cycle
from .instance_rows import UNREPORTED_MAX_RUNNING, InstanceRows, instance_snapshots, unreported_capacity
from .policies import CyclePlan, Policy
from .state import QueuedSample, SpeculativeState

# instance_rows' names are also read from here (tests, api)
__all__ = [
    "CYCLE_HISTORY",
    "UNREPORTED_MAX_RUNNING",
    "Coordinator",
    "CycleStats",
    "Queue",
    "QueueReader",
    "instance_snapshots",
    "unreported_capacity",
]

log = logging.getLogger("staleflow.coordinator")
CYCLE_HISTORY = 1000  # cycle times kept in memory
# Snapshot changes older than this are pruned every PRUNE_EVERY cycles (a reader further
# behind gets the whole snapshot): minutes of changes at most, whatever the run's length.
CHANGES_KEEP_S = 60.0
PRUNE_EVERY = 100


@dataclass
class CycleStats:
    cycles: int = 0
    routed: int = 0
    refused: int = 0  # routes the protocol turned down (speculation was off)
    interrupted: int = 0
    pulled: int = 0
    expired: int = 0
    aborted_after_ready: int = 0
    outages: int = 0  # database outages ridden through
    # wall time of the latest leader cycles (bounded: a run may last weeks)
    cycle_ms: deque[float] = field(default_factory=lambda: deque(maxlen=CYCLE_HISTORY))


@dataclass
class Queue:
    """The snapshot's queue as the cycle reads it."""

    samples: list[QueuedSample]
    reserved: dict[int, int]  # in-flight group -> its reserved buffer
    closed: set[int]  # groups that admit nothing more (occupied, consumed, dropped)
    group_versions: dict[int, int]  # in-flight group -> least V_traj of its routed members


class QueueReader:
    """Snapshot rows (QueuedView's field order) to the cycle's queue, in one pass. Between two
    cycles most of a queue is unchanged: a row seen last cycle gets last cycle's QueuedSample
    back (frozen, so shared safely) instead of a new one: building a view and a sample per row
    was 0.6 of the 1.4 ms of Python from the statement's result to the plan, on the service
    bench's queue (~600 samples). Holds only the latest queue's objects."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], QueuedSample] = {}

    def read(self, rows: Sequence[Sequence[Any]]) -> Queue:
        seen, now = self._seen, {}
        samples: list[QueuedSample] = []
        reserved: dict[int, int] = {}
        closed: set[int] = set()
        group_versions: dict[int, int] = {}
        for row in rows:
            key = tuple(row)
            q = seen.get(key)
            sid, gid, v_traj, last_version, length, tokens, state, buffer, min_version, last_instance = key
            if q is None:
                q = QueuedSample(sid, gid, length, v_traj, tokens, last_version, last_instance)
            now[key] = q
            samples.append(q)
            if state == "reserved":
                if buffer is not None:
                    reserved[gid] = buffer
                if min_version is not None:
                    group_versions[gid] = min_version
            elif state != "queued":
                closed.add(gid)
        self._seen = now
        return Queue(samples, reserved, closed, group_versions)


class Coordinator:
    def __init__(
        self,
        protocol: Protocol,
        run_id: int,
        policy: Policy,
        cost: CostModel,
        *,
        holder: str | None = None,
        lease_s: float = 3.0,
        period_s: float | None = None,
        tolerance_s: float = 0.05,
        pull_streams: int | None = None,
    ):
        self.protocol, self.run_id, self.policy, self.cost = protocol, run_id, policy, cost
        self.pull_streams = pull_streams  # the PS's streams (strategies.stagger_pulls); None: unknown
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.lease_s, self.period_s = lease_s, period_s or policy.cycle_period
        self.tolerance_s = tolerance_s
        self.epoch: int | None = None
        self.spec = SpeculativeState(tolerance=tolerance_s)
        self._queue = QueueReader()
        self._mirror = SnapshotMirror()  # the run's snapshot, kept from its changes
        self._instances = InstanceRows(self._mirror)  # its instances, kept per instance
        self._frozen = 0  # the mirror's whole reads whose state was frozen (`_freeze`)
        self._reads = 0
        self._unreported: set[int] = set()  # instances warned about reporting no capacity
        self.stats = CycleStats()
        self.database = Outage("the database", log)
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    def run(self, until: Callable[[], bool] | None = None) -> CycleStats:
        try:
            while not self._stop and not (until and until()):
                started = time.monotonic()
                if self._lead_and_cycle():
                    self.stats.cycle_ms.append((time.monotonic() - started) * 1000)
                    time.sleep(max(0.0, self.period_s - (time.monotonic() - started)))
                elif not self._stop:
                    time.sleep(self.lease_s / 3)  # standby: try again well inside a leader's lease
        finally:
            if self.epoch is not None:
                try:
                    self.protocol.release_leadership(self.run_id, self.holder)
                except Exception as exc:  # database down: the leader epoch lapses by itself
                    log.warning("could not release leadership of run %s: %s", self.run_id, exc)
        return self.stats

    def _lead_and_cycle(self) -> bool:
        """One leader cycle (or a standby's leadership check), retried through database outages.
        Returns whether we led."""
        try:
            for attempt in DATABASE_OUTAGE.retrying(
                self.database, stopping=lambda: self._stop, before_sleep=self._on_outage
            ):
                with attempt:
                    led = self.lead()
                    if led:
                        self.cycle()
        except Exception as exc:
            if self._stop and is_db_unavailable(exc):
                return False  # asked to stop while the database was down
            raise
        self.database.ok()
        self.stats.outages = self.database.count
        return led

    def _on_outage(self, _state: object) -> None:
        # What we knew may be stale by the time the database is back (another coordinator
        # may have led meanwhile): forget the epoch, so the next lead() rebuilds the state.
        self.epoch = None
        self._mirror.resync()

    def lead(self) -> bool:
        """Renew (or take) the leader epoch; a new epoch means our view must be rebuilt from scratch."""
        epoch = self.protocol.acquire_leadership(self.run_id, self.holder, self.lease_s)
        if epoch is not None and epoch != self.epoch:
            log.info("leading run %s at epoch %s", self.run_id, epoch)
            self.spec = SpeculativeState(tolerance=self.tolerance_s)
            self._mirror = SnapshotMirror()
            self._instances = InstanceRows(self._mirror)
            self._frozen = 0
        elif epoch is None and self.epoch is not None:
            log.warning("lost leadership of run %s", self.run_id)
        self.epoch = epoch
        return epoch is not None

    def cycle(self) -> None:
        if self.epoch is None:
            raise RuntimeError("a cycle needs leadership: lead() first")
        epoch = self.epoch
        t0 = time.monotonic()
        snap = self.read_snapshot()
        t1 = time.monotonic()
        if snap.state != "active":  # paused or cancelled: no routes, and no interrupts or pulls either
            self.stats.expired += len(self.protocol.expire_instances(self.run_id))
            return
        instances = self._instances.snapshots(t1, snap.config, self._unreported)
        live = {i.instance_id for i in instances}
        for gone in [i for i in self.spec.estimates if i not in live]:
            self.spec.forget(gone)
        self.spec.observe_all(instances)
        queue = self._queue.read(snap.queued_rows)
        self._freeze()
        cfg = snap.config
        admission = AdmissionView(
            {b: BufferCounts(b, o, r) for b, (o, r) in snap.buffers.items()},
            snap.version,
            cfg,
            reserved=queue.reserved,
            closed=queue.closed,
        )
        switches = self.spec.regime.switches
        out = run_cycle(
            self.policy,
            self.cost,
            self.spec,
            queue.samples,
            lambda plan: self._write(plan, epoch, snapshot_ms=(t1 - t0) * 1000, decided_from=t1),
            ps_version=snap.version,
            admission=admission,
            group_versions=queue.group_versions,
            max_response=cfg.max_response_tokens,
            pull_streams=self.pull_streams,
            now=t1,
        )
        if out.applied is None:
            return  # deposed
        if self.spec.regime.switches != switches:  # what binds the run, for its operators
            log.info("run %s: the regime estimate is now %s-bound", self.run_id, self.spec.regime.regime)
        self.stats.routed += len(out.plan.routes) - out.refused
        self.stats.refused += out.refused
        self.stats.interrupted += sum(len(d.sample_ids) for d in out.plan.interrupts)
        self.stats.pulled += len(out.plan.pulls)
        self.stats.cycles += 1
        # housekeeping of the run, cheap when there is nothing to do
        self.stats.expired += len(self.protocol.expire_instances(self.run_id))
        if cfg.buffer_capacity > cfg.batch_size:
            self.stats.aborted_after_ready += len(self.protocol.abort_after_ready(self.run_id))

    def _freeze(self) -> None:
        """After a whole read, move what it built (the mirror's rows, the kept samples, the queue)
        out of the cyclic GC's reach: it lives for many cycles, and a full collection walks
        every tracked object (70–190 ms at 50,000 in flight, every 50–100 cycles; ~5 ms once
        frozen: docs/benchmarks.md). Collected first, so no garbage of the moment is kept for good."""
        if self._mirror.wholes != self._frozen:
            self._frozen = self._mirror.wholes
            gc.collect()
            gc.freeze()

    def read_snapshot(self) -> Snapshot:
        """The run's snapshot: what changed since the last read, merged (the whole snapshot on
        the first read and after a resync); every PRUNE_EVERY reads, old changes are pruned.
        Its run, buffers and queue only: the cycle takes the instances from `InstanceRows`,
        which builds again only what changed (`instances` is empty here)."""
        m = self._mirror
        m.apply(self.protocol.snapshot_changes(self.run_id, m.position))
        self._reads += 1
        if self._reads % PRUNE_EVERY == 0:
            self.protocol.prune_snapshot_changes(self.run_id, CHANGES_KEEP_S)
        return snapshot_of(self.run_id, [m.run, m.buffers, [], None, m.queued_rows(), m.latest_params])

    def _write(self, plan: CyclePlan, epoch: int, *, snapshot_ms: float, decided_from: float) -> Applied | None:
        """The cycle's commands in one transaction fenced by our epoch, then a wake-up for the
        instances they concern. None if we were deposed meanwhile."""
        started = time.monotonic()
        routes = [(r.sample_id, r.instance_id) for r in plan.routes]
        pulls = [(p.instance_id, p.version) for p in plan.pulls]
        # write_ms is measured by apply_commands itself, inside the transaction
        stats = {
            "snapshot_ms": snapshot_ms,
            "decide_ms": (started - decided_from) * 1000,
            "migrated": len(plan.interrupts),
        }
        try:
            results = self.protocol.apply_commands(
                self.run_id,
                self.holder,
                epoch,
                routes,
                [s for d in plan.interrupts for s in d.sample_ids],
                pulls,
                cycle=stats,
            )
        except Conflict:
            log.warning("deposed while writing; standing by")
            self.epoch = None
            return None
        touched = {i for _, i in routes} | {d.instance_id for d in plan.interrupts} | {i for i, _ in pulls}
        if touched:
            self.protocol.notify_work(self.run_id, sorted(touched))
        routed = {r.sample_id for r in results if r.outcome == "routed"}
        return Applied(
            [r.sample_id in routed for r in plan.routes],
            [d.sample_ids for d in plan.interrupts],
            time.monotonic(),
        )
