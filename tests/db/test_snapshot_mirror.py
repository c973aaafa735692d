"""Snapshot changes: after any sequence of protocol operations, a mirror fed only the changes
since its last read shows what a fresh full snapshot shows (real PostgreSQL, random operations:
enqueue, register, route, partial and finished reports, interrupts, heartbeats, lapsed and
expired instances, aborted groups, rewards, training; pruning and resyncs); and the coordinator's
instance snapshots kept from those changes (`InstanceRows`) equal those built afresh from it."""

from __future__ import annotations

import random

import pytest
from protocol_helpers import Driver
from sqlalchemy import text

from staleflow_db.errors import Conflict, InvalidInput, NotFound
from staleflow_db.protocol.coordination import snapshot_of
from staleflow_db.types import Report
from workers.coordinator.instance_rows import InstanceRows, instance_snapshots
from workers.coordinator.service import QueueReader
from workers.wire.enums import SegmentKind
from workers.wire.snapshot_mirror import SnapshotMirror

MAX_QUEUED = 7  # small, so samples cross the view's edge
# weighted: enough routes, reports and rewards that groups train; a few lapses and aborts
OPS = (
    ["enqueue", "register"]
    + ["route"] * 4
    + ["report"] * 5
    + ["reward"] * 2
    + ["train"] * 2
    + ["interrupt", "heartbeat", "lapse", "expire", "abort", "read_twice", "prune"]
)


def _same(d: Driver, mirror: SnapshotMirror, kept: InstanceRows | None = None) -> None:
    full = d.p.snapshot(d.run, max_queued=MAX_QUEUED)
    view = mirror.view(MAX_QUEUED)
    merged = snapshot_of(d.run, [view.run, view.buffers, view.instances, view.running, view.queued, view.latest_params])
    assert (merged.version, merged.state, merged.config, merged.buffers, merged.latest_params) == (
        full.version,
        full.state,
        full.config,
        full.buffers,
        full.latest_params,
    )
    assert [(i.id, i.name, i.version, i.snapshot, i.running) for i in merged.instances] == [
        (i.id, i.name, i.version, i.snapshot, i.running) for i in full.instances
    ]
    assert [list(q) for q in merged.queued_rows] == full.queued_rows
    if kept is not None:  # the coordinator's inputs, kept from the changes, equal fresh ones
        assert kept.snapshots(5.0, merged.config) == instance_snapshots(merged, 5.0)
        head = [mirror.run, mirror.buffers, [], None, mirror.queued_rows(MAX_QUEUED), mirror.latest_params]
        assert QueueReader().read(snapshot_of(d.run, head).queued_rows) == QueueReader().read(merged.queued_rows)


def _read(d: Driver, mirror: SnapshotMirror) -> None:
    mirror.apply(d.p.snapshot_changes(d.run, mirror.position))


@pytest.mark.parametrize("seed", [1, 4, 5, 8])  # seeds whose operations reach training
def test_merged_changes_equal_a_full_snapshot_at_every_step(engine, seed):
    rng = random.Random(seed)
    d = Driver(engine, batch_size=2, group_size=2, samples_per_group=3, eta=1)
    mirror = SnapshotMirror()
    kept = InstanceRows(mirror)
    instances: list[int] = []
    version = 0
    _read(d, mirror)
    assert mirror.wholes == 1
    _same(d, mirror, kept)
    for step in range(150):
        op = rng.choice(OPS)
        q = d.scalars("SELECT id FROM samples WHERE run_id = :r AND state = 'queued' ORDER BY id")
        running = d.scalars("SELECT id FROM samples WHERE run_id = :r AND state = 'running' ORDER BY id")
        live = d.scalars(
            "SELECT id FROM instances WHERE run_id = :r AND state = 'active' AND lease_expires_at > now() ORDER BY id"
        )
        if op == "enqueue":
            d.enqueue(rng.randint(1, 3))
        elif op == "register" or (op == "route" and not live):
            instances.append(d.p.register_instance(d.run, f"i{step}", version))
        elif op == "route" and q:
            picks = rng.sample(q, min(len(q), rng.randint(1, 4)))
            d.route(picks, rng.choice(live))
        elif op in ("report", "interrupt") and running:
            sid = rng.choice(running)
            kind = SegmentKind.FINISHED if rng.random() < 0.6 else SegmentKind.PARTIAL
            if op == "interrupt":
                kind = SegmentKind.INTERRUPTED
            att = d.one("SELECT attempt FROM samples WHERE id = :s", s=sid)[0]
            n = rng.randint(0, 3)
            try:
                d.p.report(d.run, [Report(sid, att, version, [5] * n, [-0.1] * n, kind, **d.route_identity(sid))])
            except (Conflict, NotFound):
                pass  # a lapsed instance's report is refused: nothing changed
        elif op == "heartbeat" and live:
            try:
                d.p.heartbeat(rng.choice(live), version, {"running": rng.randint(0, 4), "kv_used": rng.randint(0, 99)})
            except Conflict:
                pass
        elif op == "lapse" and live:
            with engine.begin() as c:
                c.execute(
                    text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"),
                    {"i": rng.choice(live)},
                )
        elif op == "expire":
            d.p.expire_instances(d.run)
        elif op == "abort":
            groups = d.scalars("SELECT id FROM prompt_groups WHERE run_id = :r AND state IN ('queued', 'reserved')")
            if groups:
                d.p.abort_group(d.run, rng.choice(groups))
        elif op == "reward":
            d.reward_all(rng.random())
        elif op == "train":
            batch = d.p.consume(d.run, version)
            if batch is not None:
                d.p.publish(d.run, version, batch.consume_fence)
                version += 1
        elif op == "read_twice":
            _read(d, mirror)  # nothing changed in between: an empty change
        elif op == "prune":
            with engine.begin() as c:
                c.execute(
                    text("UPDATE snapshot_changes SET at = at - interval '1 hour' WHERE run_id = :r"), {"r": d.run}
                )
            d.p.prune_snapshot_changes(d.run, keep_s=60)
        wholes = mirror.wholes
        _read(d, mirror)
        if op == "prune" and wholes == mirror.wholes:
            # pruned below the mirror's position only when nothing was written since its read
            assert not d.rows("SELECT 1 FROM snapshot_changes WHERE run_id = :r")
        _same(d, mirror, kept)
    assert mirror.changed > 0
    assert version > 0, "no step trained: the operations should reach training"


def test_a_position_from_elsewhere_or_pruned_is_answered_whole(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    d.enqueue(2)
    m = SnapshotMirror()
    m.apply(d.p.snapshot_changes(d.run))
    assert m.wholes == 1 and len(m.queued) == 2
    doc = d.p.snapshot_changes(d.run, m.position)
    m.apply(doc)  # nothing changed (rows a transaction older than the read wrote may come again)
    assert doc[1] is False and m.wholes == 1 and len(m.queued) == 2
    assert d.p.snapshot_changes(d.run, f"{10**15}:{10**15}:")[1] is True  # from the future: whole
    for bad in ("12", "5:3:"):  # not one; xmin after xmax
        with pytest.raises(InvalidInput, match="not a snapshot position"):
            d.p.snapshot_changes(d.run, bad)
    d.enqueue(1)
    with engine.begin() as c:
        c.execute(text("UPDATE snapshot_changes SET at = at - interval '1 hour'"))
    d.p.prune_snapshot_changes(d.run, keep_s=60)
    doc = d.p.snapshot_changes(d.run, m.position)
    assert doc[1] is True and len(doc[7]) == 3
    with pytest.raises(NotFound):
        d.p.snapshot_changes(d.run + 1000)


def test_a_long_transaction_neither_hides_its_change_nor_inflates_the_others(engine):
    """A write in progress at a read is in its position's in-progress list: read once it commits,
    while the changes committed meanwhile are read once each (not again on every read)."""
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    (g,) = d.enqueue(1)
    (slow_sid,) = d.members(g)
    m = SnapshotMirror()
    with engine.connect() as slow:
        slow.execute(text("UPDATE samples SET n_tokens = 0 WHERE id = :s"), {"s": slow_sid})  # holds an xid
        m.apply(d.p.snapshot_changes(d.run))
        d.enqueue(2)
        doc = d.p.snapshot_changes(d.run, m.position)
        m.apply(doc)
        assert len(doc[7]) == 2  # the two new samples
        doc = d.p.snapshot_changes(d.run, m.position)
        m.apply(doc)
        assert doc[7] is None and doc[6] is None and doc[8] is None  # nothing since, despite the open write
        slow.commit()
    doc = d.p.snapshot_changes(d.run, m.position)
    assert [q[0] for q in doc[7]] == [slow_sid]  # its change, once committed
    m.apply(doc)
    _same(d, m)
