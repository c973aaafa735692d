"""Routes that only join groups already reserved go without the run lock (protocol/core.py,
"group locks"); one that would lower a group's version, or reserves, waits for it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from protocol_helpers import Driver
from sqlalchemy import text

from workers.wire.types import RouteOutcome

WAIT_S = 60  # guards against a hang, never a timing assertion
RUN_LOCK = "SELECT id FROM runs WHERE id = :r FOR NO KEY UPDATE"


def waiting_for_the_run_lock(d: Driver) -> int:
    return d.scalars(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query LIKE '%staleflow_lock_run%'"
    )[0]


def test_a_member_joining_a_reserved_group_routes_while_another_holds_the_run_lock(engine):
    d = Driver(engine, batch_size=1, group_size=3, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    s1, s2, s3 = d.members(g)
    d.routed([s1], inst)  # reserves: under the run lock
    with engine.connect() as holder, ThreadPoolExecutor(1) as pool:
        with holder.begin():
            holder.execute(text(RUN_LOCK), {"r": d.run})
            joined = pool.submit(d.route, [s2, s3], inst).result(timeout=WAIT_S)  # while it is held
    assert [r.outcome for r in joined] == [RouteOutcome.ROUTED] * 2
    assert {r.buffer for r in joined} == {d.group(g)[1]}
    assert d.buffers() == {1: (0, 1)}  # one reservation, for the group: nothing counted twice
    d.finish({r.sample_id: r.attempt for r in joined} | {s1: 1})
    assert [o.state for o in d.reward_all()] == ["occupied"]
    d.train(0)
    assert d.violations() == []


def test_a_join_below_a_members_version_waits_for_the_run_lock(engine):
    """A member at version 0 joining a group whose other member runs at version 1 would lower
    the group's version (and so its window): that is buffer accounting, under the run lock."""
    d = Driver(engine, batch_size=1, group_size=2, eta=2)
    old = d.p.register_instance(d.run, "old", 0)
    (first,) = d.enqueue(1)
    d.complete(d.members(first), old)
    d.train(0)  # version 1
    new = d.p.register_instance(d.run, "new", 1)
    (g,) = d.enqueue(1)
    s1, s2 = d.members(g)
    d.routed([s1], new)  # reserves at version 1
    with engine.connect() as holder, ThreadPoolExecutor(1) as pool:
        tx = holder.begin()
        holder.execute(text(RUN_LOCK), {"r": d.run})
        late = pool.submit(d.route, [s2], old)
        deadline = time.monotonic() + WAIT_S
        while not waiting_for_the_run_lock(d):
            assert time.monotonic() < deadline, "the join never waited for the run lock"
            assert not late.done(), late.result()
            time.sleep(0.01)
        tx.commit()
        (result,) = late.result(timeout=WAIT_S)
    # decided under the run lock: version 0's window ends before the buffer reserved at 1
    assert result.outcome == RouteOutcome.JOIN_REFUSED
    assert d.violations() == []
