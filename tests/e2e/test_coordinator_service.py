"""The coordinator service on a real database: it routes within the staleness budget, pulls an
idle instance that is behind, and a standby takes over from a SIGKILLed leader."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from protocol_helpers import Driver

from staleflow_db.protocol import Protocol
from workers.coordinator.cost_model import get_cost_model
from workers.coordinator.policies import get_policy
from workers.coordinator.service import Coordinator

SNAP = {
    "running": 0,
    "waiting": 0,
    "kv_used": 0,
    "capacity": {"max_running": 256, "kv_capacity": 100_000},
    "running_samples": [],
    "throughput": 0.0,
}


def _coordinator(engine, run, policy="staleflow", **kw):
    return Coordinator(
        Protocol(engine), run, get_policy(policy, **kw), get_cost_model("qwen_7b", "TP1_PP1"), holder="t"
    )


def test_routes_within_the_budget_and_records_cycles(engine):
    d = Driver(engine, batch_size=2, group_size=2, eta=1)
    a, b = d.p.register_instance(d.run, "a", 0), d.p.register_instance(d.run, "b", 0)
    for i in (a, b):
        d.p.heartbeat(i, 0, SNAP)
    d.enqueue(6)
    c = _coordinator(engine, d.run)
    assert c.lead()
    for _ in range(3):
        c.cycle()
    placed = d.rows("SELECT instance_id, count(*) FROM samples WHERE run_id = :r AND state = 'running' GROUP BY 1")
    assert {i for i, _ in placed} == {a, b}  # the waterfall spreads work over both
    assert sum(n for _, n in placed) == 8  # (eta + 1) * B = 4 groups of N = 2: admission control
    assert d.scalars("SELECT count(*) FROM prompt_groups WHERE run_id = :r AND state = 'reserved'") == [4]
    assert d.scalars("SELECT sum(routed) FROM coordinator_cycles WHERE run_id = :r") == [8]
    # the time spent writing each cycle's commands is measured, not a placeholder
    assert d.scalars("SELECT bool_and(write_ms > 0) FROM coordinator_cycles WHERE run_id = :r") == [True]
    assert d.violations() == []


def test_pulls_an_idle_instance_that_is_behind(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    a = d.p.register_instance(d.run, "a", 0)
    (g,) = d.enqueue(1)
    d.complete(d.members(g), a)
    d.train(0)
    d.p.heartbeat(a, 0, SNAP)
    c = _coordinator(engine, d.run)
    assert c.lead()
    c.cycle()
    cmds = d.p.poll_work(a).commands
    assert [(x.kind, x.target_version) for x in cmds] == [("pull", 1)]


def test_standby_takes_over_from_a_killed_leader(engine, db_url):
    d = Driver(engine, name="failover", batch_size=1, group_size=1, eta=1)
    env = {**os.environ, "STALEFLOW_DATABASE_URL": db_url}
    cmd = [
        sys.executable,
        "-m",
        "staleflow_cli.main",
        "coordinator",
        "--run",
        "failover",
        "--lease",
        "1",
        "--period",
        "0.05",
    ]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    try:

        def leadership():
            rows = d.rows("SELECT holder, epoch, expires_at > now() FROM leader_epochs WHERE run_id = :r")
            return rows[0] if rows else None

        deadline = time.monotonic() + 60
        while not (leadership() and leadership()[2]) and time.monotonic() < deadline:
            time.sleep(0.1)
        holder, epoch, _ = leadership()
        leader = next(p for p in procs if holder.endswith(f":{p.pid}"))
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (leadership()[0] == holder or not leadership()[2]):
            time.sleep(0.1)
        new_holder, new_epoch, live = leadership()
        assert new_holder != holder and new_epoch == epoch + 1 and live
        # the new leader works: it routes a queued sample to a live instance
        inst = d.p.register_instance(d.run, "i", 0)
        d.p.heartbeat(inst, 0, SNAP)
        (g,) = d.enqueue(1)
        deadline = time.monotonic() + 20
        while d.sample(d.members(g)[0])[0] != "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.sample(d.members(g)[0])[0] == "running"
        assert d.scalars("SELECT DISTINCT epoch FROM coordinator_cycles WHERE run_id = :r AND routed > 0") == [
            new_epoch
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=20)


def test_a_paused_run_routes_nothing_until_resumed(engine):
    """Paused, the coordinator's cycles route, interrupt and pull nothing (and write no cycle
    row); resumed, it routes as before."""
    from workers.wire.enums import RunState

    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    a = d.p.register_instance(d.run, "a", 0)
    d.p.heartbeat(a, 0, SNAP)
    d.enqueue(2)
    d.p.set_state(d.run, RunState.PAUSED, "maintenance")
    c = _coordinator(engine, d.run)
    assert c.lead()
    for _ in range(3):
        c.cycle()
    assert d.scalars("SELECT count(*) FROM samples WHERE run_id = :r AND state <> 'queued'") == [0]
    assert d.scalars("SELECT count(*) FROM coordinator_cycles WHERE run_id = :r") == [0]
    d.p.set_state(d.run, RunState.ACTIVE)
    c.cycle()
    assert d.scalars("SELECT count(*) FROM samples WHERE run_id = :r AND state = 'running'") == [4]
    assert d.violations() == []
