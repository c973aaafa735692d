"""A reader's copy of a run's coordinator snapshot, kept current from snapshot changes.

The snapshot-changes read (`GET /v1/runs/{run}/snapshot/changes`, `Protocol.snapshot_changes`)
returns what changed since the reader's last `position`, or the whole snapshot when asked
without one (or when the server can no longer answer from there). `SnapshotMirror.apply` merges
either into the copy; `view` is then what the full snapshot statement would have returned at
that read: the live instances (id order) with their rows and running samples, and the oldest
`max_queued` queued samples. The copy holds every queued sample and every running one
(including those on instances whose lease lapsed: they return to the view if it is renewed),
so a view equals the full snapshot after any sequence of changes (tests/db/test_snapshot_mirror.py).

Sample rows are kept as tuples, in the field order of the full snapshot's rows: a tuple of
numbers, strings and None is untracked by Python's cyclic GC, so the copy of tens of thousands
of samples adds nothing to the full collections that land in a coordinator cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# the document's fields, in order (coordination.sql, `snapshot_changes`)
FIELDS = (
    "position",
    "whole",
    "run",
    "buffers",
    "live",
    "instances",
    "running",
    "queued",
    "gone",
    "latest_params",
)


@dataclass
class SnapshotView:
    """The full snapshot's parts as rows: run, buffers [idx, occupied, reserved], instances
    [id, name, version, snapshot, age], running [instance, sample, tokens, prompt, v_traj]
    (sample order), queued (oldest first), latest published version."""

    run: dict[str, Any] | None
    buffers: list[list[Any]]
    instances: list[list[Any]]
    running: list[tuple[Any, ...]]
    queued: list[tuple[Any, ...]]
    latest_params: int | None

    def rows(self) -> list[Any]:
        """As the full snapshot statement returns them (`staleflow_db.protocol.snapshot_of`)."""
        return [self.run, self.buffers, self.instances, self.running, self.queued, self.latest_params]


class SnapshotMirror:
    def __init__(self) -> None:
        self.position: str | None = None  # the next read's `since` (None: ask for the whole)
        self.run: dict[str, Any] | None = None
        self.buffers: list[list[Any]] = []
        self.live: list[list[Any]] = []  # [id, snapshot age] of the live instances, id order
        self.latest_params: int | None = None
        self.instances: dict[int, list[Any]] = {}  # live id -> [id, name, version, snapshot]
        self.running: dict[int, tuple[Any, ...]] = {}  # sample id -> running row
        self.queued: dict[int, tuple[Any, ...]] = {}  # sample id -> queued row
        # instance id -> its running rows by sample id, and per instance the samples whose
        # running rows there changed since the last `take_touched` (started, progressed, left):
        # a reader that keeps work of its own per sample redoes only theirs
        self.by_instance: dict[int, dict[int, tuple[Any, ...]]] = {}
        self.touched: dict[int, set[int]] = {}
        self._queued_sorted: list[int] | None = []
        self.wholes = 0  # whole snapshots applied (the first, and every resync)
        self.changed = 0  # sample rows applied from changes

    def resync(self) -> None:
        """Ask for the whole snapshot on the next read."""
        self.position = None

    def apply(self, doc: Sequence[Any] | dict[str, Any]) -> None:
        """Merge one read's document (the array, or an object with FIELDS as keys)."""
        d = dict(zip(FIELDS, doc, strict=True)) if not isinstance(doc, dict) else doc
        if d["whole"]:
            self.instances.clear()
            self.running.clear()
            self.queued.clear()
            self.by_instance.clear()
            self.touched.clear()
            self._queued_sorted = None
            self.wholes += 1
        self.run, self.buffers, self.latest_params = d["run"], d["buffers"] or [], d["latest_params"]
        self.live = d["live"] or []
        for row in d["instances"] or ():
            self.instances[row[0]] = row
        live = {i for i, _ in self.live}
        for gone in [i for i in self.instances if i not in live]:
            del self.instances[gone]  # lapsed: a renewal rewrites the row, which comes back then
        for row in d["running"] or ():
            self._leave(row[1])
            self.running[row[1]] = r = tuple(row)
            self.by_instance.setdefault(r[0], {})[r[1]] = r
            self.touched.setdefault(r[0], set()).add(r[1])
            if self.queued.pop(row[1], None) is not None:
                self._queued_sorted = None
        for row in d["queued"] or ():
            self._leave(row[0])
            if row[0] not in self.queued and self._queued_sorted is not None:
                self._queued_sorted = None
            self.queued[row[0]] = tuple(row)
        for sid in d["gone"] or ():
            self._leave(sid)
            if self.queued.pop(sid, None) is not None:
                self._queued_sorted = None
        self.changed += len(d["running"] or ()) + len(d["queued"] or ()) + len(d["gone"] or ())
        missing = live - self.instances.keys()
        # a live instance whose row this copy never got (only after a server-side anomaly):
        # the next read is whole, this view leaves it out
        self.position = None if missing else d["position"]

    def _leave(self, sid: int) -> None:
        """The sample no longer runs where the copy had it (it runs elsewhere, or not at all)."""
        old = self.running.pop(sid, None)
        if old is not None:
            rows = self.by_instance[old[0]]
            del rows[sid]
            if not rows:
                del self.by_instance[old[0]]
            self.touched.setdefault(old[0], set()).add(sid)

    def take_touched(self) -> dict[int, set[int]]:
        """Per instance, the samples whose running rows there changed since the last call
        (after a whole read, any may have: see `wholes`)."""
        touched, self.touched = self.touched, {}
        return touched

    def queued_rows(self, max_queued: int = 20_000) -> list[tuple[Any, ...]]:
        """The oldest `max_queued` queued rows, oldest first (as `view` gives them)."""
        if self._queued_sorted is None:
            self._queued_sorted = sorted(self.queued)
        return [self.queued[s] for s in self._queued_sorted[:max_queued]]

    def view(self, max_queued: int = 20_000) -> SnapshotView:
        live = [(i, age) for i, age in self.live if i in self.instances]
        ids = {i for i, _ in live}
        return SnapshotView(
            self.run,
            self.buffers,
            [[*self.instances[i], age] for i, age in live],
            [r for _, r in sorted(self.running.items()) if r[0] in ids],
            self.queued_rows(max_queued),
            self.latest_params,
        )
