"""Coordinator data layer: leader epochs, the cycle snapshot, fenced commands."""

from __future__ import annotations

import threading

import pytest
from protocol_helpers import Driver
from sqlalchemy import text

from staleflow_db.errors import Conflict, NotFound
from staleflow_db.types import Report
from workers.wire.enums import SegmentKind
from workers.wire.types import RouteOutcome


def test_one_leader_at_a_time_and_takeover_fences_the_old_one(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    assert d.p.acquire_leadership(d.run, "a", ttl_seconds=30) == 1
    assert d.p.acquire_leadership(d.run, "a", ttl_seconds=30) == 1  # renewal keeps the epoch
    assert d.p.acquire_leadership(d.run, "b", ttl_seconds=30) is None  # a's lease is live
    with engine.begin() as c:
        c.execute(text("UPDATE leader_epochs SET expires_at = now() - interval '1 s'"))
    assert d.p.acquire_leadership(d.run, "b", ttl_seconds=30) == 2
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    with pytest.raises(Conflict, match="not the coordinator"):
        d.p.apply_commands(d.run, "a", 1, routes=[(d.members(g)[0], inst)])
    assert d.sample(d.members(g)[0])[0] == "queued"
    (r,) = d.p.apply_commands(d.run, "b", 2, routes=[(d.members(g)[0], inst)], cycle={"snapshot_ms": 1.0})
    assert r.outcome == RouteOutcome.ROUTED
    assert d.rows("SELECT epoch, routed FROM coordinator_cycles WHERE run_id = :r") == [(2, 1)]
    d.p.release_leadership(d.run, "b")
    assert d.p.acquire_leadership(d.run, "c") == 3


def test_snapshot_and_commands(engine):
    d = Driver(engine, batch_size=2, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    d.p.heartbeat(inst, 0, {"running": 1, "kv_tokens": 12})
    g1, g2 = d.enqueue(2)
    (s1,), (s2,) = d.members(g1), d.members(g2)
    att = d.routed([s1], inst)
    d.p.report(d.run, [Report(s1, att[s1], 0, [4, 5], [-1.0, -1.0], SegmentKind.PARTIAL, **d.route_identity(s1))])
    epoch = d.p.acquire_leadership(d.run, "coord")
    snap = d.p.snapshot(d.run)
    assert snap.version == 0 and snap.buffers == {1: (0, 1)}
    (iv,) = snap.instances
    assert (iv.id, iv.version, iv.snapshot["kv_tokens"], iv.running) == (inst, 0, 12, [(s1, 2, 3, 0)])
    (q,) = snap.queued
    assert (q.sample_id, q.v_traj, q.length, q.group_state, q.group_buffer) == (s2, None, 3, "queued", None)
    d.p.apply_commands(d.run, "coord", epoch, interrupts=[s1, s2], pulls=[(inst, 0)])
    cmds = d.p.poll_work(inst).commands
    assert [(c.kind, c.sample_id, c.target_version) for c in cmds] == [("interrupt", s1, None), ("pull", None, 0)]


def test_notify_work_reaches_a_listener(engine, db_url):
    import psycopg

    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute("LISTEN staleflow")
        d.p.notify_work(d.run, [3, 1])
        (n,) = list(listener.notifies(timeout=5, stop_after=1))
    assert n.payload == f"-|{d.run}|work:1,work:3"


def test_a_deposed_leaders_cycle_is_refused_whole(engine):
    """The fence goes last with the cycle's row: a cycle written after a takeover is a 409
    and leaves nothing behind (no route, no command, no cycle row)."""
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    g1, g2 = d.enqueue(2)
    running = d.members(g1)[0]
    d.routed([running], inst)
    assert d.p.acquire_leadership(d.run, "a", ttl_seconds=30) == 1
    with engine.begin() as c:
        c.execute(text("UPDATE leader_epochs SET expires_at = now() - interval '1 s'"))
    assert d.p.acquire_leadership(d.run, "b", ttl_seconds=30) == 2
    queued = d.members(g2)[0]
    with pytest.raises(Conflict, match="not the coordinator"):
        d.p.apply_commands(
            d.run, "a", 1, routes=[(queued, inst)], interrupts=[running], pulls=[(inst, 0)], cycle={"snapshot_ms": 1.0}
        )
    assert d.sample(queued)[0] == "queued"
    assert d.rows("SELECT count(*) FROM commands WHERE run_id = :r") == [(0,)]
    assert d.rows("SELECT count(*) FROM coordinator_cycles WHERE run_id = :r") == [(0,)]
    d.p.apply_commands(d.run, "b", 2, interrupts=[running], cycle={"snapshot_ms": 1.0})
    assert d.rows("SELECT epoch, interrupted FROM coordinator_cycles WHERE run_id = :r") == [(2, 1)]


def test_commands_without_routes_do_not_wait_for_the_run_lock(engine):
    """Interrupts and pulls move no buffer: a cycle of only those is not held up by a
    run-locked transaction (a report, a consume) in progress; routes still wait for it."""
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    running, queued = d.members(g)
    d.routed([running], inst)
    epoch = d.p.acquire_leadership(d.run, "a", ttl_seconds=30)
    with engine.connect() as holder:
        holder.execute(text("SELECT id FROM runs WHERE id = :r FOR NO KEY UPDATE"), {"r": d.run})
        done = threading.Event()
        worker = threading.Thread(
            target=lambda: (
                d.p.apply_commands(d.run, "a", epoch, interrupts=[running], pulls=[(inst, 0)], cycle={}),
                done.set(),
            )
        )
        worker.start()
        assert done.wait(10), "a cycle without routes waited for the run lock"
        routing = threading.Thread(target=lambda: d.p.apply_commands(d.run, "a", epoch, routes=[(queued, inst)]))
        routing.start()
        routing.join(0.5)
        assert routing.is_alive(), "a route did not wait for the run lock"
        holder.rollback()
    routing.join(10)
    assert d.sample(queued)[0] == "running"
    cmds = d.p.poll_work(inst).commands
    assert [(c.kind, c.sample_id) for c in cmds] == [("interrupt", running), ("pull", None)]


def test_a_cycle_without_routes_is_fenced_and_all_or_nothing(engine):
    """A cycle of only interrupts and pulls (one statement): from a deposed leader it is a 409,
    with a sample not in the run a 404, and either way nothing is written; from the leader its
    commands, their events and its row (with the write time measured) are."""
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    running, queued = d.members(g)
    d.routed([running], inst)
    assert d.p.acquire_leadership(d.run, "a", ttl_seconds=30) == 1
    cycle = {"snapshot_ms": 2.0, "decide_ms": 3.0, "migrated": 1}
    written = (
        "SELECT (SELECT count(*) FROM commands WHERE run_id = :r), (SELECT count(*) FROM coordinator_cycles"
        " WHERE run_id = :r), (SELECT count(*) FROM events WHERE run_id = :r AND kind = 'pull')"
    )
    with pytest.raises(NotFound, match=f"sample {queued + 1000}"):
        d.p.apply_commands(d.run, "a", 1, interrupts=[running, queued + 1000], pulls=[(inst, 0)], cycle=cycle)
    assert d.rows(written) == [(0, 0, 0)]
    with engine.begin() as c:
        c.execute(text("UPDATE leader_epochs SET expires_at = now() - interval '1 s'"))
    with pytest.raises(Conflict, match="not the coordinator"):
        d.p.apply_commands(d.run, "a", 1, interrupts=[running], pulls=[(inst, 0)], cycle=cycle)
    assert d.rows(written) == [(0, 0, 0)]
    assert d.p.acquire_leadership(d.run, "b", ttl_seconds=30) == 2
    # a queued sample is not running: no command for it, as with `interrupt`
    assert d.p.apply_commands(d.run, "b", 2, interrupts=[running, queued], pulls=[(inst, 0)], cycle=cycle) == []
    assert d.rows(written) == [(2, 1, 1)]
    ((row, write_ms),) = d.rows(
        "SELECT (epoch, snapshot_ms, decide_ms, routed, interrupted, pulled, migrated)::text, write_ms"
        " FROM coordinator_cycles WHERE run_id = :r"
    )
    assert row == "(2,2,3,0,2,1,1)" and write_ms > 0
    cmds = d.p.poll_work(inst).commands
    assert [(c.kind, c.sample_id, c.target_version) for c in cmds] == [("interrupt", running, None), ("pull", None, 0)]
    # nothing to do is a cycle too: its row, fenced; so are pulls alone
    d.p.apply_commands(d.run, "b", 2, cycle={})
    assert d.rows(written) == [(2, 2, 1)]
    d.p.apply_commands(d.run, "b", 2, pulls=[(inst, 0)], cycle={})
    assert d.rows(written) == [(3, 3, 2)]
