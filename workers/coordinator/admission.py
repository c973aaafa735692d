"""Admission: will the protocol's Reserve (or group join) succeed for a route?

Strategies ask through an `Admission` object: `AdmissionView` models the buffer counters
with the protocol's own placement rules (`staleflow_db.rules.route_decision`) and records the
reservations this cycle's routes make; `CallbackAdmission` wraps any callable, e.g. one that
asks the database; `AlwaysAdmit` admits everything.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Mapping
from typing import Protocol

from staleflow_db.rules import BufferCounts, Limits, reserve_target, route_decision

from .state import QueuedSample


class Admission(Protocol):
    """`admits`: would routing `sample` to an instance at `instance_version` be accepted?
    `commit`: it was decided; account for it (later answers see it). Optionally `key(sample)`:
    samples with equal keys get equal answers at every version until the next commit — lets
    strategies ask once per class of samples instead of once per sample."""

    def admits(self, sample: QueuedSample, instance_version: int) -> bool: ...

    def commit(self, sample: QueuedSample, instance_version: int) -> None: ...


class AlwaysAdmit:
    def admits(self, sample: QueuedSample, instance_version: int) -> bool:
        return True

    def commit(self, sample: QueuedSample, instance_version: int) -> None:
        pass

    def key(self, sample: QueuedSample) -> Hashable:
        return ()


class CallbackAdmission:
    """Wrap `fn(sample, instance_version) -> bool` (and an optional `on_commit`)."""

    def __init__(
        self, fn: Callable[[QueuedSample, int], bool], on_commit: Callable[[QueuedSample, int], None] | None = None
    ):
        self.fn, self.on_commit = fn, on_commit

    def admits(self, sample: QueuedSample, instance_version: int) -> bool:
        return bool(self.fn(sample, instance_version))

    def commit(self, sample: QueuedSample, instance_version: int) -> None:
        if self.on_commit is not None:
            self.on_commit(sample, instance_version)


class AdmissionView:
    """What the protocol's route would answer, without touching it (copy-on-write counters).

    `reserved` maps each in-flight group to its reserved buffer; groups in `closed` (occupied,
    consumed, dropped) admit nothing; other groups are queued (their first route reserves).
    """

    def __init__(
        self,
        buffers: Mapping[int, BufferCounts],
        version_now: int,
        limits: Limits,
        reserved: Mapping[int, int],
        closed: Container[int] = (),
    ):
        self._buffers = buffers
        self._copied: dict[int, BufferCounts] = {}
        self.version_now = version_now
        self.limits = limits
        self._reserved = reserved
        self._new_reserved: dict[int, int] = {}
        self._closed = closed
        self._memo: dict[tuple, bool] = {}

    def _buffer_map(self) -> Mapping[int, BufferCounts]:
        if not self._copied:
            return self._buffers
        merged = dict(self._buffers)
        merged.update(self._copied)
        return merged

    def group_buffer(self, group_id: int) -> int | None:
        b = self._new_reserved.get(group_id)
        return b if b is not None else self._reserved.get(group_id)

    def decision(self, sample: QueuedSample, instance_version: int) -> tuple[str, int | None, int | None]:
        if sample.group_id in self._closed:
            return "group_closed", None, None
        return route_decision(
            has_tokens=sample.tokens > 0,
            v_traj=sample.v_traj,
            last_version=sample.last_version,
            instance_version=instance_version,
            group_reserved_buffer=self.group_buffer(sample.group_id),
            buffers=self._buffer_map(),
            version_now=self.version_now,
            limits=self.limits,
        )

    def key(self, sample: QueuedSample) -> Hashable:
        """Everything `route_decision` reads of a sample: equal keys, equal answers."""
        if sample.group_id in self._closed:
            return ("closed",)
        return (sample.tokens > 0, sample.v_traj, sample.last_version, self.group_buffer(sample.group_id))

    def admits(self, sample: QueuedSample, instance_version: int) -> bool:
        k = (self.key(sample), instance_version)
        ok = self._memo.get(k)
        if ok is None:
            ok = self._memo[k] = self.decision(sample, instance_version)[0] == "routed"
        return ok

    def can_reserve(self, version: int) -> bool:
        """Could a new group reserve a buffer entry at `version` (the staleness budget has room)?"""
        return reserve_target(self._buffer_map(), version, self.version_now, self.limits) is not None

    def next_buffer_ready(self) -> bool:
        """Is the next buffer the trainer consumes (the run's version, or the one after while
        that one trains) already full: the rollout is ahead of the trainer."""
        bufs = self._buffer_map()
        for b in (self.version_now, self.version_now + 1):
            buf = bufs.get(b)
            if buf is not None and not buf.consumed:
                return buf.occupied >= self.limits.batch_size
        return False

    def commit(self, sample: QueuedSample, instance_version: int) -> None:
        outcome, _, b = self.decision(sample, instance_version)
        if outcome != "routed" or b is None:
            return
        if b not in self._copied:
            old = self._buffers.get(b)
            self._copied[b] = BufferCounts(b, old.occupied, old.reserved, old.consumed) if old else BufferCounts(b)
        self._copied[b].reserved += 1
        self._new_reserved[sample.group_id] = b
        self._memo.clear()  # buffer counters changed
