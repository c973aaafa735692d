"""The database's instance rows to the strategies' `InstanceSnapshot`s: from a `Snapshot`
(`instance_snapshots`), or kept per instance from a `SnapshotMirror` (`InstanceRows`).

`InstanceRows` builds an instance's running samples again only when its running rows or its
row (its heartbeat) changed since the last cycle, or when its heartbeat shows samples waiting
for their environment (their `env_since` is on the coordinator's clock, which moves): a cycle's
Python then follows what changed, not every sample in flight, and allocates no per-sample
objects for the cyclic GC to walk. Its snapshots equal `instance_snapshots` of the mirror's
view at every step (tests/unit/test_instance_rows.py, tests/db/test_snapshot_mirror.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from staleflow_db.protocol import Snapshot
from staleflow_db.types import RunConfig
from workers.wire.snapshot_mirror import SnapshotMirror

from .state import InstanceSnapshot, RunningSample

log = logging.getLogger("staleflow.coordinator")

# An instance that reported no capacity (docs/coordinator.md#capacity): one request at a time.
UNREPORTED_MAX_RUNNING = 1


def unreported_capacity(config: RunConfig) -> dict[str, int]:
    """The capacity assumed for an instance that reported none: one request at a time, with KV
    room for one longest sample of the run (its prompt and response budgets)."""
    return {
        "max_running": UNREPORTED_MAX_RUNNING,
        "kv_capacity": config.max_prompt_tokens + config.max_response_tokens,
    }


def instance_snapshots(snap: Snapshot, now: float, unreported: set[int] | None = None) -> list[InstanceSnapshot]:
    """Database rows to the strategies' view: the heartbeat snapshot, with running samples'
    progress taken from whichever is fresher (heartbeat or reported segments), and the engine's
    reported capacity (`unreported_capacity` when it reported none; such instances are added
    to `unreported`, warned about once).

    Requests count at least the samples the database holds running on the instance: a route
    the engine has not taken in yet, or a finish not reported yet, still occupies a slot, so
    routing up to `max_running` never puts more than that many samples on the instance —
    except those the heartbeat reports waiting for their environment (`env_waiting`): they
    hold no slot (docs/coordinator.md, "Multi-turn trajectories")."""
    out = []
    for inst in snap.instances:
        hb = inst.snapshot or {}
        at = now - (inst.snapshot_age_s if inst.snapshot_age_s is not None else 1e9)
        held = _held(inst.running, hb, at)
        out.append(_snapshot(inst.id, inst.name, inst.version, hb, at, held, snap.config, unreported))
    return out


class _Held(NamedTuple):
    """An instance's running samples, with what the snapshot sums over them."""

    samples: tuple[RunningSample, ...]
    env_waiting: int  # of them, waiting for their environment
    kv: int  # the context of the others (the KV they hold)
    timed: bool  # some carry an `env_since`: built again every cycle


def _held(running: Iterable[Any], hb: Mapping[str, Any], at: float) -> _Held:
    beat = {r["sample_id"]: r for r in hb.get("running_samples", [])}
    samples = tuple(_running_sample(sid, n, prompt, v, beat.get(sid), at) for sid, n, prompt, v in running)
    env = sum(1 for r in samples if r.in_env)
    return _Held(samples, env, sum(r.length for r in samples if not r.in_env), env > 0)


def _snapshot(
    iid: int,
    name: str,
    version: int,
    hb: Mapping[str, Any],
    at: float,
    held: _Held,
    config: RunConfig,
    unreported: set[int] | None,
) -> InstanceSnapshot:
    capacity = hb.get("capacity")
    if capacity is None:
        capacity = unreported_capacity(config)
        if unreported is not None and iid not in unreported:
            unreported.add(iid)
            log.warning(
                "instance %s (%s) reported no capacity: routed %s request at a time",
                iid,
                name,
                UNREPORTED_MAX_RUNNING,
            )
    waiting = int(hb.get("waiting", 0))
    # of the samples the database holds here, those the heartbeat saw waiting for their
    # environment: no slot, no KV (a trajectory answered since is back in the queue)
    return InstanceSnapshot(
        instance_id=iid,
        version=version,
        running=max(int(hb.get("running", 0)), len(held.samples) - waiting - held.env_waiting),
        waiting=waiting,
        kv_used=int(hb.get("kv_used", held.kv)),
        kv_capacity=int(capacity["kv_capacity"]),
        running_samples=held.samples,
        throughput=float(hb.get("throughput", 0.0)),
        heartbeat_at=at,
        snapshot_at=at,
        pulling=bool(hb.get("pulling", False)),
        routed_seen=hb.get("routed_seen"),
        max_running=int(capacity["max_running"]),
        env_waiting=held.env_waiting,
    )


def _running_sample(sid: int, n: int, prompt: int, v: int, beat: dict[str, Any] | None, at: float) -> RunningSample:
    """A sample the database holds on an instance (`n` response tokens reported in segments),
    with the heartbeat's fresher progress: tokens, the current turn's tokens and, while it
    waits for its environment, since when (the heartbeat's wait, on the coordinator's clock)."""
    if beat is None:
        return RunningSample(sid, n, prompt + n, v)
    tokens = max(n, int(beat.get("tokens", 0)))
    waited = beat.get("env_waited_s")
    return RunningSample(
        sid,
        tokens,
        prompt + tokens,
        v,
        turn_tokens=beat.get("turn_tokens"),
        env_since=None if waited is None else at - float(waited),
    )


class _Kept:
    """One instance's running samples as last built, by sample id, with the instance row and
    heartbeat entries they were built from."""

    def __init__(self, row: list[Any], hb: Mapping[str, Any]) -> None:
        self.samples: dict[int, RunningSample] = {}
        self.env = self.kv = 0
        self.held = _Held((), 0, 0, False)
        self.beat: dict[int, dict[str, Any]] = {}
        self.see(row, hb)

    def see(self, row: list[Any], hb: Mapping[str, Any]) -> set[int]:
        """Take the instance's (new) row; returns the samples whose heartbeat entry changed."""
        old = self.beat
        self.row, self.beat = row, {r["sample_id"]: r for r in hb.get("running_samples", [])}
        self.waits = [s for s, b in self.beat.items() if b.get("env_waited_s") is not None]
        return {s for s in self.beat.keys() | old.keys() if self.beat.get(s) != old.get(s)}

    def timed(self) -> list[int]:
        """Its running samples waiting for their environment (their `env_since` is on our clock)."""
        return [s for s in self.waits if s in self.samples]

    def redo(self, sids: Iterable[int], rows: Mapping[int, tuple[Any, ...]], at: float) -> None:
        """Build again the samples `sids` (those no longer running here leave)."""
        samples, beat = self.samples, self.beat
        for sid in sids:
            old = samples.pop(sid, None)
            if old is not None:
                self._count(old, -1)
            r = rows.get(sid)
            if r is not None:
                samples[sid] = new = _running_sample(sid, r[2], r[3], r[4], beat.get(sid), at)
                self._count(new, 1)
        in_order = tuple(map(samples.__getitem__, sorted(samples)))
        self.held = _Held(in_order, self.env, self.kv, bool(self.timed()))

    def _count(self, r: RunningSample, sign: int) -> None:
        if r.in_env:
            self.env += sign
        else:
            self.kv += sign * r.length


class InstanceRows:
    """`instance_snapshots` of a mirror's view, with each running sample kept from the cycle
    before unless its running row, or its instance's heartbeat entry for it, changed."""

    def __init__(self, mirror: SnapshotMirror) -> None:
        self.mirror = mirror
        self._wholes = mirror.wholes
        self._kept: dict[int, _Kept] = {}  # live instance id -> its running samples
        self.built = 0  # running samples built (the others were kept)

    def snapshots(self, now: float, config: RunConfig, unreported: set[int] | None = None) -> list[InstanceSnapshot]:
        m = self.mirror
        kept = self._kept
        touched = m.take_touched()
        if m.wholes != self._wholes:
            kept, self._wholes = {}, m.wholes
        now_kept: dict[int, _Kept] = {}
        out = []
        for iid, age in m.live:
            row = m.instances.get(iid)
            if row is None:
                continue  # as the view: a live instance whose row the copy lacks is left out
            hb = row[3] or {}
            at = now - (age if age is not None else 1e9)
            rows = m.by_instance.get(iid, {})
            k = kept.get(iid)
            if k is None:  # new, back from a lapse, or after a whole read: all of it
                k = _Kept(row, hb)
                redo: set[int] | list[int] = list(rows)
            else:
                redo = touched.get(iid, set())
                if k.row is not row:  # a heartbeat: and the samples whose entry in it changed
                    redo = redo | k.see(row, hb)
                if k.held.timed:  # environment waits are on our clock, which moved
                    redo = set(redo).union(k.timed())
            if redo:
                k.redo(redo, rows, at)
                self.built += len(redo)
            now_kept[iid] = k
            out.append(_snapshot(iid, row[1], row[2], hb, at, k.held, config, unreported))
        self._kept = now_kept
        return out
