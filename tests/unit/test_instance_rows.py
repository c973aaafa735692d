"""The coordinator's instance snapshots kept per instance from a `SnapshotMirror` (`InstanceRows`)
equal those built afresh from the mirror's view (`instance_snapshots`) after every step of
random changes: running samples started, progressing, moving, queued again and gone; heartbeats
with and without per-sample progress, environment waits and capacity; lapsed and renewed
instances; whole reads. Only the samples that changed (and those waiting for their environment,
on the coordinator's moving clock) are built again."""

from __future__ import annotations

import random

import pytest

from staleflow_db.protocol import snapshot_of
from staleflow_db.types import RunConfig
from workers.coordinator.instance_rows import InstanceRows, instance_snapshots
from workers.wire.run_config import CONFIG_FIELDS
from workers.wire.snapshot_mirror import SnapshotMirror

CONFIG = RunConfig(batch_size=4, group_size=2, eta=1)
RUN = {"id": 1, "version": 3, "state": "active", **{f: getattr(CONFIG, f) for f in CONFIG_FIELDS}}
INSTANCES = range(1, 9)


class World:
    """What the database holds, and the documents a reader of its changes gets."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.rows: dict[int, list] = {}  # instance rows
        self.live: set[int] = set()
        self.running: dict[int, list] = {}  # sample -> running row
        self.queued: dict[int, list] = {}
        self.next_sid = 1

    def heartbeat(self, i: int) -> dict | None:
        rng = self.rng
        if rng.random() < 0.1:
            return None
        hb: dict = {"running": rng.randint(0, 4), "waiting": rng.randint(0, 2)}
        if rng.random() < 0.7:
            hb["capacity"] = {"max_running": rng.randint(1, 8), "kv_capacity": rng.randint(100, 5000)}
        if rng.random() < 0.5:
            hb["kv_used"] = rng.randint(0, 999)
        mine = [s for s, r in self.running.items() if r[0] == i]
        beats = []
        for s in rng.sample(mine, rng.randint(0, len(mine))) + [10_000 + i]:  # and one it no longer holds
            b: dict = {"sample_id": s, "tokens": rng.randint(0, 50)}
            if rng.random() < 0.3:
                b["turn_tokens"] = rng.randint(0, 10)
            if rng.random() < 0.2:
                b["env_waited_s"] = rng.random()
            beats.append(b)
        if beats and rng.random() < 0.8:
            hb["running_samples"] = beats
        return hb

    def step(self, whole: bool) -> list:
        rng = self.rng
        instances, running, queued, gone = [], [], [], []
        for _ in range(rng.randint(0, 3)):  # register, or heartbeat (a renewal rewrites the row)
            i = rng.choice(INSTANCES)
            self.rows[i] = [i, f"i{i}", rng.randint(0, 3), self.heartbeat(i)]
            self.live.add(i)
            instances.append(self.rows[i])
        if self.live and rng.random() < 0.15:
            self.live.discard(rng.choice(sorted(self.live)))  # lapsed (its row stays)
        for _ in range(rng.randint(0, 3)):
            self.queued[self.next_sid] = [self.next_sid, self.next_sid // 2, None, None, 5, 0, "queued"] + [None] * 3
            queued.append(self.queued[self.next_sid])
            self.next_sid += 1
        for _ in range(rng.randint(0, 6)):
            op = rng.random()
            if op < 0.35 and self.queued and self.rows:  # routed (or resumed)
                s = rng.choice(sorted(self.queued))
                del self.queued[s]
                self.running[s] = [rng.choice(sorted(self.rows)), s, 0, rng.randint(1, 20), rng.randint(0, 3)]
                running.append(self.running[s])
            elif op < 0.6 and self.running:  # a partial segment reported
                s = rng.choice(sorted(self.running))
                self.running[s] = r = [*self.running[s]]
                r[2] += rng.randint(1, 9)
                running.append(r)
            elif op < 0.7 and self.running and self.rows:  # moved (interrupted, resumed elsewhere at once)
                s = rng.choice(sorted(self.running))
                self.running[s] = r = [rng.choice(sorted(self.rows)), *self.running[s][1:]]
                running.append(r)
            elif op < 0.85 and self.running:  # interrupted: queued again
                s = rng.choice(sorted(self.running))
                r = self.running.pop(s)
                self.queued[s] = [s, s // 2, r[4], r[4], r[3] + r[2], r[2], "reserved", 0, r[4], r[0]]
                queued.append(self.queued[s])
            elif self.running or self.queued:  # finished and scored, or dropped
                s = rng.choice(sorted(self.running.keys() | self.queued.keys()))
                self.running.pop(s, None)
                self.queued.pop(s, None)
                gone.append(s)
        live = [[i, rng.choice([None, rng.random() * 3])] for i in sorted(self.live)]
        if whole:
            on_live = [r for r in self.running.values() if r[0] in self.live]
            instances = [self.rows[i] for i in sorted(self.live)]
            running, queued, gone = on_live, list(self.queued.values()), []
        return ["1:1:", whole, RUN, [[0, 0, 0]], live, instances, running, queued, gone, 2]


@pytest.mark.parametrize("seed", range(6))
def test_kept_instance_snapshots_equal_fresh_ones_at_every_step(seed):
    rng = random.Random(seed)
    world = World(rng)
    mirror = SnapshotMirror()
    rows = InstanceRows(mirror)
    warned_fresh: set[int] = set()
    warned_kept: set[int] = set()
    kept_some = False
    for step in range(400):
        mirror.apply(world.step(whole=step == 0 or rng.random() < 0.03))
        now = 1000.0 + step * 0.1
        view = mirror.view()
        fresh = instance_snapshots(snapshot_of(1, view.rows()), now, warned_fresh)
        built = rows.built
        kept = rows.snapshots(now, CONFIG, warned_kept)
        assert kept == fresh, step
        assert warned_kept == warned_fresh
        assert mirror.queued_rows() == view.queued
        kept_some |= rows.built - built < sum(len(s.running_samples) for s in fresh)
        # nothing changed since: only the samples in environment waits are built again
        timed = sum(1 for s in fresh for r in s.running_samples if r.env_since is not None)
        built = rows.built
        assert rows.snapshots(now, CONFIG) == fresh
        assert rows.built - built == timed
    assert kept_some
