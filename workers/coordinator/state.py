"""What the coordinator sees: snapshots, and its speculative state (docs/coordinator.md).

A *snapshot* is what the database says about the cluster at one instant: per instance its
model version, running and waiting counts, KV-cache usage, per-running-sample token counts,
generation throughput and heartbeat time; the queued samples by version; the buffers.

The *speculative state* is the coordinator's own running estimate per instance. It changes
the moment the coordinator issues a command (route: +1 request and +len KV tokens; pull: the
version after the pull; interrupt: -1 request and -len tokens). An instance snapshot replaces
the estimate only if it is newer than the estimate's last local change (within a tolerance)
*and* its request count agrees; otherwise it is stale (it was taken before the instance saw
the commands) and is dropped. Without this, an instance that looks empty in a lagging
snapshot is flooded with routes, cycle after cycle.

"Request count agrees": when the snapshot carries `routed_seen` (the cumulative number of
routed requests the engine has taken in) it must have seen every route the coordinator sent
(`routed_seen >= routed_sent`); finishes and interrupts do not disturb that comparison. A
snapshot without the counter is compared on its current requests (running + waiting). An
estimate whose last local change is older than `expire_after` seconds yields to any newer
snapshot, so a disagreement that finishes explain (a sample ended between two heartbeats)
cannot pin a wrong estimate forever.

Pure data and bookkeeping: no I/O, no clock reads (times are passed in).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .regime import RegimeEstimate


class RunningSample(NamedTuple):
    """A trajectory an instance holds: decoding (or queued in the engine), or — multi-turn —
    between two turns, waiting for its environment (`env_since` set). One waiting for its
    environment holds no decode slot and no KV the batch counts (its context may sit in the
    engine's prefix cache): it is not in the instance's `running`, `waiting` or `kv_used`, and
    the coordinator never counts its wait as decode load (docs/coordinator.md, "Multi-turn")."""

    sample_id: int
    tokens: int  # response tokens generated so far (all segments, all turns)
    length: int  # context: prompt + observations + tokens (the KV it holds, or needs to resume)
    v_traj: int
    turn_tokens: int | None = None  # tokens of its current turn so far (None: single-turn, = tokens)
    env_since: float | None = None  # waiting for its environment since then (None: not waiting)

    @property
    def in_env(self) -> bool:
        return self.env_since is not None

    @property
    def current_turn_tokens(self) -> int:
        return self.tokens if self.turn_tokens is None else self.turn_tokens


@dataclass(frozen=True)
class InstanceSnapshot:
    instance_id: int
    version: int  # model version loaded (the old one while a pull is in progress)
    running: int
    waiting: int
    kv_used: int  # KV-cache tokens held by running samples
    kv_capacity: int
    running_samples: Sequence[RunningSample] = ()  # a tuple, or any read-only sequence
    throughput: float = 0.0  # measured generation tokens/s over the last heartbeat interval
    heartbeat_at: float = 0.0
    snapshot_at: float = 0.0
    pulling: bool = False
    routed_seen: int | None = None  # cumulative routed requests the engine has taken in
    # the engine's running slots (its reported Capacity, docs/coordinator.md#capacity): no
    # default, so no view can silently lack the cap
    max_running: int = field(kw_only=True)
    # trajectories it holds between turns, waiting for their environment
    env_waiting: int = field(default=0, kw_only=True)

    @property
    def requests(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class QueuedSample:
    """A sample waiting in the trajectory server (new prompt member or interrupted partial)."""

    sample_id: int
    group_id: int
    length: int  # prompt + tokens so far (the KV it needs)
    v_traj: int | None = None  # None: never routed
    tokens: int = 0  # response tokens generated so far
    last_version: int | None = None  # version of its latest segment with tokens
    last_instance: int | None = None  # the instance it last ran on (None: never ran)

    @property
    def fresh(self) -> bool:
        """No tokens yet: it takes the version of the instance it is routed to (version raise)."""
        return self.tokens == 0

    @property
    def min_instance_version(self) -> int:
        """Lowest instance version that may run it: its latest segment's version (>= V_traj).

        A sample that was routed once keeps its V_traj even if it was interrupted before its
        first token (V_traj only grows), so it too needs an instance at V_traj or newer; a
        never-routed sample can go anywhere (0)."""
        if self.v_traj is None:
            return 0
        return self.v_traj if self.last_version is None else max(self.v_traj, self.last_version)


@dataclass(frozen=True)
class BufferSnapshot:
    index: int
    occupied: int
    reserved: int
    consumed: bool = False


@dataclass(frozen=True)
class ClusterSnapshot:
    """One short read-only transaction's worth of cluster state."""

    taken_at: float
    run_version: int  # the run's (trainer's) version
    ps_version: int  # latest version on the parameter server (== run_version once published)
    instances: tuple[InstanceSnapshot, ...]
    queued: tuple[QueuedSample, ...]
    buffers: tuple[BufferSnapshot, ...] = ()
    # reserved (in-flight) groups: id -> (reserved buffer, min member version)
    reserved_groups: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    closed_groups: frozenset[int] = frozenset()  # occupied / consumed / dropped
    batch_size: int = 1
    buffer_capacity: int = 1
    eta: int = 0


@dataclass
class InstanceView:
    """The per-instance state strategies read (and update on a local copy as they decide)."""

    instance_id: int
    version: int
    running: int
    waiting: int
    kv_used: int
    kv_capacity: int
    running_samples: Sequence[RunningSample] = ()
    throughput: float = 0.0
    pulling: bool = False
    max_running: int = field(kw_only=True)  # as InstanceSnapshot's
    # held between turns: no decode slot, not in `running` nor `kv_used`
    env_waiting: int = field(default=0, kw_only=True)

    @property
    def requests(self) -> int:
        return self.running + self.waiting

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_capacity if self.kv_capacity else 1.0

    def copy(self) -> InstanceView:
        return InstanceView(
            self.instance_id,
            self.version,
            self.running,
            self.waiting,
            self.kv_used,
            self.kv_capacity,
            self.running_samples,
            self.throughput,
            self.pulling,
            max_running=self.max_running,
            env_waiting=self.env_waiting,
        )

    @classmethod
    def of(cls, s: InstanceSnapshot) -> InstanceView:
        return cls(
            s.instance_id,
            s.version,
            s.running,
            s.waiting,
            s.kv_used,
            s.kv_capacity,
            s.running_samples,
            s.throughput,
            s.pulling,
            max_running=s.max_running,
            env_waiting=s.env_waiting,
        )


@dataclass
class InstanceEstimate:
    view: InstanceView
    last_change_at: float = float("-inf")  # time of the latest local command
    snapshot_at: float = float("-inf")  # time of the latest accepted snapshot
    routed_sent: int = 0  # cumulative routes the coordinator sent to this instance
    pull_version: int | None = None  # a pull in progress, until a snapshot shows it done


class SpeculativeState:
    def __init__(self, tolerance: float = 0.0, expire_after: float = 2.0):
        self.tolerance = tolerance
        self.expire_after = expire_after
        self.estimates: dict[int, InstanceEstimate] = {}
        self.accepted = 0
        self.dropped = 0
        # which resource binds the run, updated by every cycle (cycle.run_cycle, regime.py)
        self.regime = RegimeEstimate()
        self.regime_label = "open"  # the latest cycle's instantaneous label

    # ---- snapshots -------------------------------------------------------------------------

    def observe(self, snap: InstanceSnapshot) -> bool:
        """Take the snapshot if it is fresh and agrees; returns whether it was accepted."""
        est = self.estimates.get(snap.instance_id)
        if est is None:
            self.estimates[snap.instance_id] = InstanceEstimate(
                InstanceView.of(snap),
                snapshot_at=snap.snapshot_at,
                routed_sent=snap.routed_seen or 0,
                pull_version=None,
            )
            self.accepted += 1
            return True
        if snap.snapshot_at <= est.snapshot_at and est.snapshot_at != float("-inf"):
            self.dropped += 1  # not newer than what we already have
            return False
        newer = snap.snapshot_at + self.tolerance > est.last_change_at
        if snap.routed_seen is not None:
            agrees = snap.routed_seen >= est.routed_sent
        else:
            agrees = snap.requests == est.view.requests
        if est.pull_version is not None and (snap.pulling or snap.version < est.pull_version):
            agrees = False  # the pull we ordered is not visible yet
        expired = snap.snapshot_at >= est.last_change_at + self.expire_after
        if not ((newer and agrees) or expired):
            self.dropped += 1
            return False
        view = InstanceView.of(snap)
        if est.pull_version is not None:
            if snap.pulling or snap.version < est.pull_version:
                view.pulling, view.version = True, max(view.version, est.pull_version)
            else:
                est.pull_version = None
        est.view = view
        est.snapshot_at = snap.snapshot_at
        if snap.routed_seen is not None:
            est.routed_sent = max(est.routed_sent, snap.routed_seen)
        self.accepted += 1
        return True

    def observe_all(self, snaps: Iterable[InstanceSnapshot]) -> tuple[list[int], list[int]]:
        acc: list[int] = []
        drop: list[int] = []
        for s in snaps:
            (acc if self.observe(s) else drop).append(s.instance_id)
        return acc, drop

    def forget(self, instance_id: int) -> None:
        self.estimates.pop(instance_id, None)

    # ---- local commands --------------------------------------------------------------------

    def on_route(self, instance_id: int, length: int, now: float) -> None:
        """+1 request, +length KV tokens (per-sample details arrive with the next snapshot)."""
        est = self.estimates[instance_id]
        v = est.view
        if v.kv_used + length <= v.kv_capacity and v.running < v.max_running:
            v.running += 1
            v.kv_used += length
        else:
            v.waiting += 1
        est.routed_sent += 1
        est.last_change_at = max(est.last_change_at, now)

    def on_pull(self, instance_id: int, version: int, now: float) -> None:
        est = self.estimates[instance_id]
        v = est.view
        v.running = v.waiting = v.kv_used = v.env_waiting = 0
        v.running_samples = ()
        v.throughput = 0.0
        v.pulling = True
        v.version = max(v.version, version)
        est.pull_version = version
        est.last_change_at = max(est.last_change_at, now)

    def on_interrupt(self, instance_id: int, sample_ids: Sequence[int], now: float, tokens: int | None = None) -> None:
        """-1 request (and -its length) per interrupted sample; `tokens` overrides the KV drop.
        A trajectory waiting for its environment held neither: it leaves `env_waiting`."""
        est = self.estimates[instance_id]
        v = est.view
        ids = set(sample_ids)
        known = [s for s in v.running_samples if s.sample_id in ids]
        in_env = sum(1 for s in known if s.env_since is not None)
        drop = tokens if tokens is not None else sum(s.length for s in known if s.env_since is None)
        v.running = max(0, v.running - (len(ids) - in_env))
        v.env_waiting = max(0, v.env_waiting - in_env)
        v.kv_used = max(0, v.kv_used - drop)
        if known:
            v.running_samples = tuple(s for s in v.running_samples if s.sample_id not in ids)
        est.last_change_at = max(est.last_change_at, now)

    # ---- reading ---------------------------------------------------------------------------

    def view(self, instance_id: int) -> InstanceView:
        return self.estimates[instance_id].view

    def views(self, copy: bool = True) -> list[InstanceView]:
        """In instance-id order: copies, or (copy=False) the live estimates — fine for the
        strategies, which never modify their inputs."""
        if copy:
            return [self.estimates[i].view.copy() for i in sorted(self.estimates)]
        return [self.estimates[i].view for i in sorted(self.estimates)]
