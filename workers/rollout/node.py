"""A rollout node: one process driving several engine instances (the instances a GPU node
hosts), whose calls share one HTTP request and one database transaction (POST
/v1/runs/{run}/instances/sync).

Each instance is a `RolloutWorker` in its own thread (its engine steps in parallel with the
others', as on their own GPUs); what it would send by itself goes to the node instead:

- Reports and heartbeats: one flush thread sends them. A flush starts when any instance has a
  report due (the node's one report timer, `report_every_s`, once its earliest pending report is
  due: a finish waits out its slack) or a heartbeat; it asks every other instance to hand over
  what it has pending at the end of its current step (waiting for them at most the longest step
  a live instance took last, within `gather_s` and MAX_GATHER_S: a shorter wait leaves out every
  instance mid-step, which then opens a flush of its own), and sends everything in one sync: the
  instances share one report timer, so a busy node of K instances makes one flush where K
  instances made K reports. Outcomes are per instance and go back to its worker: lost routes
  drop those samples, a fenced instance registers again. Syncs go one at a time, in order: what
  an instance handed over later is never applied before what it handed over first.
- Work and commands: one poll thread long-polls for every instance at once (each poll renews
  the lease of every instance it names, as its own poll did) and hands each worker what is its
  own. It names only instances whose worker loop ticks, so a hung engine still lets its lease
  lapse. An instance registered again while a long-poll is in flight is named from the next one.

Registration, deregistration and trajectory drops stay each instance's own calls (rare)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.client import Conflict, StaleFlowClient
from workers.rollout.worker_inbox import Delivery
from workers.wire import models as m

if TYPE_CHECKING:
    from workers.rollout.worker import RolloutWorker

log = logging.getLogger("staleflow.rollout")


@dataclass(frozen=True)
class Settled:
    """The outcome of an instance's part of a flush that was refused (409): `lost` the samples
    whose route it lost (dropped locally), `fenced` the instance itself (it registers again)."""

    instance_id: int
    lost: frozenset[int] = frozenset()
    fenced: bool = False


class Wake:
    """Handed to an idle worker when a flush asks for its pending reports."""


WAKE = Wake()
# the longest a flush waits for the node's other instances to hand over (their engine step)
MAX_GATHER_S = 0.1


@dataclass
class Part:
    """What one instance hands to a flush: a report batch (one segment per sample, its snapshot
    riding along) and/or a heartbeat."""

    worker: RolloutWorker
    instance_id: int
    reports: list[dict] = field(default_factory=list)
    snapshot: dict[str, Any] | None = None
    heartbeat: dict[str, Any] | None = None
    done: threading.Event | None = None  # set when its sync returned (a forced flush waits)


class NodeInbox:
    """A worker's inbox on the node: deliveries of the node's poll, outcomes of its flushes,
    wake-ups (the interface of worker_inbox.Inbox)."""

    def __init__(self, node: Node):
        self.node = node
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    @property
    def last_poll(self) -> float:
        return self.node.last_poll

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get(self, timeout: float) -> list[Any]:
        out: list[Any] = []
        try:
            out.append(self.q.get(timeout=timeout) if timeout > 0 else self.q.get_nowait())
            while True:
                out.append(self.q.get_nowait())
        except queue.Empty:
            return out


class Node:
    def __init__(
        self,
        client: StaleFlowClient,
        run_id: int,
        *,
        report_every_s: float = 0.05,
        gather_s: float = 0.02,
        poll_wait_s: float = 5.0,
    ):
        self.client, self.run_id = client, run_id
        self.report_every_s, self.gather_s, self.poll_wait_s = report_every_s, gather_s, poll_wait_s
        self.calls: Counter[str] = Counter()  # syncs sent: "flush", "poll"
        self.last_flush = 0.0  # monotonic time the latest flush was taken (the node's report timer)
        self.last_poll = 0.0
        self._workers: list[RolloutWorker] = []
        self._inboxes: dict[int, NodeInbox] = {}  # by id(worker)
        self._cond = threading.Condition()
        self._parts: list[Part] = []
        self._epoch = 0  # the flush gathering now (0: none yet)
        self._gathering = False
        self._deadline = 0.0
        self._handed: set[int] = set()  # id(worker) of those that handed over for this epoch
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._flusher, name="node-flush", daemon=True),
            threading.Thread(target=self._poller, name="node-poll", daemon=True),
        ]

    # ---- the workers' side -----------------------------------------------------------------

    def attach(self, worker: RolloutWorker) -> NodeInbox:
        inbox = NodeInbox(self)
        with self._cond:
            self._workers.append(worker)
            self._inboxes[id(worker)] = inbox
        return inbox

    def asked(self, worker: RolloutWorker) -> bool:
        """Whether a flush is gathering and waits for this worker's pending reports."""
        return self._gathering and id(worker) not in self._handed

    @property
    def due_at(self) -> float:
        """The node's report timer: a pending report goes once the monotonic clock reaches it."""
        return self.last_flush + self.report_every_s

    def hand(self, worker: RolloutWorker, part: Part | None, force: bool = False) -> None:
        """Hand over `part` (None: nothing pending, to a flush that asked); `force` sends it at
        once and waits until its sync returned."""
        if part is not None and force:
            part.done = threading.Event()
        with self._cond:
            if part is not None:
                self._parts.append(part)
                if not self._gathering:  # this part opens a flush: ask the others
                    self._gathering, self._epoch = True, self._epoch + 1
                    self._deadline = time.monotonic() + (0.0 if force else self._gather_s())
                    self._handed = set()
                    for w in self._workers:
                        if w is not worker:
                            self._inboxes[id(w)].q.put(WAKE)
                elif force:
                    self._deadline = time.monotonic()
            if self._gathering:
                self._handed.add(id(worker))
            self._cond.notify_all()
        if part is not None and part.done is not None:
            part.done.wait()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """After every worker has stopped (their last flushes sent): stop both threads."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(self.poll_wait_s + 5.0)

    # ---- flushing --------------------------------------------------------------------------

    def _flusher(self) -> None:
        while True:
            with self._cond:
                while not self._parts and not self._stop.is_set():
                    self._cond.wait(0.5)
                if not self._parts:
                    return
                while self._gathering and not self._all_handed():
                    left = self._deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._gathering = False
                taken, self._parts = _one_per_instance(self._parts)
                self.last_flush = time.monotonic()
            self._send(taken)

    def _gather_s(self) -> float:
        """How long a flush waits for the others: until each ends the step it is in (the last
        one it took), at least `gather_s`, at most MAX_GATHER_S."""
        longest = max((w.step_s for w in self._workers if w.instance_id is not None), default=0.0)
        return max(self.gather_s, min(MAX_GATHER_S, longest))

    def _all_handed(self) -> bool:
        live = [w for w in self._workers if w.instance_id is not None and w._looping()]
        return all(id(w) in self._handed for w in live)

    def _send(self, taken: list[list[Part]]) -> None:
        items = []
        for parts in taken:
            item: dict[str, Any] = {"instance_id": parts[0].instance_id}
            for p in parts:
                if p.reports:
                    item["reports"], item["snapshot"] = p.reports, p.snapshot
                if p.heartbeat is not None:
                    item["heartbeat"] = p.heartbeat
            items.append(item)
        try:
            self.calls["flush"] += 1
            out = self.client.sync(self.run_id, items)
        except BaseException as exc:  # each worker raises it in its thread
            for parts in taken:
                self._put(parts[0], Delivery(parts[0].instance_id, None, exc, time.monotonic()))
            self._done(taken)
            if not isinstance(exc, Exception):
                raise
            return
        for parts, result in zip(taken, out.results, strict=True):
            if result.status == 200:
                continue
            sent = {r["sample_id"] for p in parts for r in p.reports}
            named = {int(i["id"]) for i in (result.error.items if result.error is not None else [])}
            lost = frozenset(named & sent)
            self._put(parts[0], Settled(parts[0].instance_id, lost, fenced=not lost))
        self._done(taken)

    def _put(self, part: Part, what: Any) -> None:
        self._inboxes[id(part.worker)].q.put(what)

    @staticmethod
    def _done(taken: list[list[Part]]) -> None:
        for parts in taken:
            for p in parts:
                if p.done is not None:
                    p.done.set()

    # ---- polling ---------------------------------------------------------------------------

    def _poller(self) -> None:
        fenced: set[int] = set()  # refused instances: not polled again until they register anew
        while not self._stop.is_set():
            with self._cond:
                workers = {w.instance_id: w for w in self._workers if w.instance_id is not None and w._looping()}
            ids = [i for i in workers if i not in fenced]
            if not ids:
                self._stop.wait(0.01)
                continue
            self.last_poll = time.monotonic()
            try:
                self.calls["poll"] += 1
                out = self.client.sync(self.run_id, poll=ids, wait=self.poll_wait_s)
            except BaseException as exc:
                if not self._stop.is_set():
                    for w in workers.values():
                        self._inboxes[id(w)].q.put(Delivery(w.instance_id or 0, None, exc, time.monotonic()))
                return
            now = time.monotonic()
            for d in out.deliveries:
                q = self._inboxes[id(workers[d.instance_id])].q
                if d.status != 200:
                    fenced.add(d.instance_id)
                    msg = d.error.message if d.error is not None else "fenced"
                    q.put(Delivery(d.instance_id, None, Conflict(409, "conflict", msg), now))
                elif d.work or d.commands:
                    q.put(Delivery(d.instance_id, m.PollOut(work=d.work, commands=d.commands), None, now))


def _one_per_instance(parts: list[Part]) -> tuple[list[list[Part]], list[Part]]:
    """The parts one sync takes, grouped by instance (at most one report batch and one heartbeat
    each, in the order handed over), and those left for the next sync."""
    taken: dict[int, list[Part]] = {}
    left: list[Part] = []
    blocked: set[int] = set()  # an instance with a part left: its later parts wait too (order)
    for p in parts:
        group = taken.get(p.instance_id, [])
        clash = (p.reports and any(q.reports for q in group)) or (
            p.heartbeat is not None and any(q.heartbeat is not None for q in group)
        )
        if p.instance_id in blocked or clash or len(taken) >= m.MAX_NODE_INSTANCES and not group:
            left.append(p)
            blocked.add(p.instance_id)
            continue
        taken.setdefault(p.instance_id, []).append(p)
    return list(taken.values()), left
