"""Any call of an instance renews its lease: over real HTTP to a real API process, a report or a
poll extends a live lease (a quarter of it gone at least), a lapsed lease stays lapsed and the
call is refused (409), a report's snapshot is what the coordinator reads, and a real rollout
worker kept busy holds its lease with no heartbeat at all until its engine hangs, when the
lease lapses."""

from __future__ import annotations

import threading
import time

import pytest
from api_helpers import ApiServer, token
from sqlalchemy import text

from staleflow_db.db import make_engine
from staleflow_db.protocol import Protocol
from workers.client import Conflict
from workers.coordinator.service import instance_snapshots
from workers.rollout.engines.sim_engine import SimEngine
from workers.rollout.worker import RolloutWorker

LEASE = 30.0


def _wait(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not reached: {what}")


class Db:
    def __init__(self, url: str):
        self.engine = make_engine(url)

    def lease_left(self, iid: int) -> float:
        with self.engine.connect() as c:
            return c.execute(
                text("SELECT extract(epoch FROM lease_expires_at - now())::float8 FROM instances WHERE id = :i"),
                {"i": iid},
            ).scalar_one()

    def age(self, iid: int) -> float:
        """Seconds since the instance registered (the database's clock)."""
        with self.engine.connect() as c:
            return c.execute(
                text("SELECT extract(epoch FROM now() - created_at)::float8 FROM instances WHERE id = :i"), {"i": iid}
            ).scalar_one()

    def set_lease_left(self, iid: int, seconds: float) -> None:
        with self.engine.begin() as c:
            c.execute(
                text("UPDATE instances SET lease_expires_at = now() + make_interval(secs => :s) WHERE id = :i"),
                {"i": iid, "s": seconds},
            )


@pytest.fixture
def routed(db_url):
    """An instance (30-s lease) holding one routed, delivered sample."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("lease", batch_size=1, group_size=1, eta=0, max_response_tokens=100).id
        admin.enqueue(run, [("p", [1, 2, 3])])
        rollout = server.client(token(db_url, "rollout", run))
        iid = rollout.register(run, "i", 0, lease_seconds=LEASE).instance_id
        (sid,) = [q.sample_id for q in admin.snapshot(run).queued]
        admin.route(run, [(sid, iid)])
        (work,) = rollout.poll(run, iid, wait=0).work
        db = Db(db_url)
        try:
            yield admin, rollout, run, iid, work, db
        finally:
            db.engine.dispose()


def _partial(work, n: int = 1) -> dict:
    return {
        "sample_id": work.sample_id,
        "attempt": work.attempt,
        "route_token": work.route_token,
        "version": 0,
        "tokens": [5] * n,
        "logprobs": [-0.5] * n,
        "kind": "partial",
    }


def test_reports_and_polls_renew_a_live_lease_and_never_a_lapsed_one(routed):
    admin, rollout, run, iid, work, db = routed
    db.set_lease_left(iid, 2.0)  # most of the lease gone, no heartbeat since
    assert rollout.report(run, iid, [_partial(work)]) == 1
    assert db.lease_left(iid) > LEASE - 5  # renewed by its own lease length
    db.set_lease_left(iid, 2.0)
    rollout.poll(run, iid, wait=0)
    assert db.lease_left(iid) > LEASE - 5
    # less than a quarter gone: the lease is left as it is (no write for every call)
    db.set_lease_left(iid, LEASE - 1)
    before = db.lease_left(iid)
    rollout.report(run, iid, [_partial(work)])
    assert db.lease_left(iid) <= before
    # lapsed: refused, and not renewed by the refused call
    db.set_lease_left(iid, -1.0)
    with pytest.raises(Conflict):
        rollout.report(run, iid, [_partial(work)])
    with pytest.raises(Conflict):
        rollout.poll(run, iid, wait=0)
    assert db.lease_left(iid) < 0
    assert admin.expire_instances(run) == [iid]
    assert [q.sample_id for q in admin.snapshot(run).queued] == [work.sample_id]


def test_a_trajectory_drop_renews_the_lease_too(routed):
    admin, rollout, run, iid, work, db = routed
    db.set_lease_left(iid, 2.0)
    assert rollout.drop_trajectories(run, iid, [(work.sample_id, work.attempt, work.route_token)], "env_failed") == [
        work.sample_id
    ]
    assert db.lease_left(iid) > LEASE - 5


def test_a_report_carries_the_snapshot_the_coordinator_reads(routed, db_url):
    admin, rollout, run, iid, work, db = routed
    snap = {"running": 1, "kv_used": 40, "running_samples": [{"sample_id": work.sample_id, "tokens": 37}]}
    rollout.report(run, iid, [_partial(work, 3)], snapshot=snap)
    (inst,) = admin.snapshot(run).instances
    (entry,) = inst.snapshot["running_samples"]
    assert (entry["sample_id"], entry["tokens"], inst.snapshot["kv_used"]) == (work.sample_id, 37, 40)
    eng = make_engine(db_url)
    try:
        (view,) = instance_snapshots(Protocol(eng).snapshot(run), time.time())
    finally:
        eng.dispose()
    (rs,) = view.running_samples
    assert (rs.sample_id, rs.tokens, view.kv_used) == (work.sample_id, 37, 40)  # fresher than the 3 reported


class _Hanging(SimEngine):
    """A sim engine whose step can be made to hang (an engine stuck on its device)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.hang = threading.Event()
        self.release = threading.Event()

    def step(self):
        if self.hang.is_set():
            self.release.wait(120)
        return super().step()


@pytest.mark.slow
def test_a_busy_worker_holds_its_lease_without_heartbeats_until_its_engine_hangs(db_url):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("busy", batch_size=40, group_size=2, eta=0, max_response_tokens=100).id
        admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(40)])
        sent: list[str] = []
        client = server.client(token(db_url, "rollout", run))
        client.http.event_hooks["request"].append(lambda r: sent.append(r.url.path.rsplit("/", 1)[-1]))
        engine = _Hanging(max_running=4, time_scale=1.0)
        # a 10-s lease, renewed by its reports and 1-s polls: no heartbeat unless no call went for 5 s
        worker = RolloutWorker(
            client, run, engine, name="busy", lease_s=10.0, heartbeat_s=3600, snapshot_every_s=3600, poll_wait_s=1.0
        )
        t = threading.Thread(target=worker.run, daemon=True)
        t.start()
        db = Db(db_url)
        try:
            _wait(lambda: worker.instance_id is not None, "registered")
            first = worker.instance_id
            queued = [q.sample_id for q in admin.snapshot(run).queued]
            done = 0
            # four at a time, until the worker has been busy for longer than its lease
            while db.age(first) < 12.0:
                batch, queued = queued[:4], queued[4:]
                assert len(batch) == 4, "the samples ran out before a lease passed"
                admin.route(run, [(s, first) for s in batch])
                done += 4
                _wait(lambda done=done: worker.stats.finished >= done, "the samples finished", 120)
            assert worker.instance_id == first and worker.stats.lost == 0  # never fenced
            assert db.lease_left(first) > 0  # renewed: it would have lapsed by now
            assert "heartbeat" not in sent and "segments" in sent and "poll" in sent
            # the engine hangs: the loop stops, the inbox stops polling, the lease lapses
            engine.hang.set()
            hung = queued[:4]
            admin.route(run, [(s, first) for s in hung])
            _wait(lambda: db.lease_left(first) < 0, "the lease to lapse", 60)
            assert admin.expire_instances(run) == [first]
            assert set(hung) <= {q.sample_id for q in admin.snapshot(run).queued}
        finally:
            engine.release.set()
            worker.stop()
            t.join(30)
            db.engine.dispose()
