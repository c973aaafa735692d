"""Instance leases and report fencing, against the real
PostgreSQL and, where the API is involved, a real `staleflow serve` over HTTP.

Races are made deterministic, never slept on: one connection holds a row lock the operation
under test needs next, the test waits until PostgreSQL shows the other transaction(s) waiting
on a lock (pg_stat_activity), then lets go.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import text

from staleflow_db.errors import Conflict, InvalidInput
from staleflow_db.payloads import unpack_tokens
from staleflow_db.types import Report
from tests.api_helpers import ApiServer, token
from tests.protocol_helpers import Driver
from workers.client import Conflict as ApiConflict
from workers.client import Forbidden as ApiForbidden
from workers.wire.enums import SegmentKind
from workers.wire.types import RouteOutcome


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def lock_waiters(engine) -> int:
    """Backends of this database blocked on a lock right now."""
    with engine.connect() as c:
        return c.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar()


def running_on_fenced(d: Driver) -> list:
    """Samples running on an instance that is not active: they would never finish nor requeue."""
    return d.rows(
        "SELECT s.id, i.state::text FROM samples s JOIN instances i ON i.id = s.instance_id"
        " WHERE s.run_id = :r AND s.state = 'running' AND i.state <> 'active'"
    )


def segments(d: Driver) -> list:
    rows = d.rows(
        "SELECT sample_id, seq, instance_id, attempt, token_ids FROM segments WHERE run_id = :r ORDER BY 1, 2"
    )
    return [(*r[:4], unpack_tokens(r[4])) for r in rows]


# ---- item 2: a route racing an expiry or a deregistration -----------------------------------


def _race_route_against(d: Driver, engine, inst: int, sample: int, fence, before_fence=lambda: None):
    """Route `sample` to `inst` while `fence()` (expiry or deregistration) commits in between:
    the route is held on the group's row lock (taken after it has looked at the instance)."""
    (gid,) = d.scalars("SELECT group_id FROM samples WHERE id = :s", s=sample)
    with ThreadPoolExecutor(2) as pool, engine.connect() as holder:
        holder.begin()
        holder.execute(text("SELECT 1 FROM prompt_groups WHERE id = :g FOR UPDATE"), {"g": gid})
        routing = pool.submit(d.p.route, d.run, [(sample, inst)])
        wait_for(lambda: lock_waiters(engine) == 1, "the route to wait on the group lock")
        before_fence()
        fencing = pool.submit(fence)
        # unfixed, the fence commits at once; fixed, it waits for the route's lock on the instance
        wait_for(lambda: fencing.done() or lock_waiters(engine) == 2, "the fence to commit or wait")
        holder.rollback()
        return routing.result(), fencing.result()


def test_route_racing_a_deregistration_leaves_nothing_running_on_it(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    inst = d.p.register_instance(d.run, "leaving", 0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    (routed,), requeued = _race_route_against(d, engine, inst, s, lambda: d.p.deregister_instance(inst))
    # Either order is fine (routed, then requeued by the deregistration; or refused), but the
    # sample must not stay running on the deregistered instance.
    assert running_on_fenced(d) == []
    assert d.sample(s)[0] == "queued"
    assert routed.outcome == RouteOutcome.ROUTED and requeued == [s]


def test_route_racing_an_expiry_leaves_nothing_running_on_it(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    inst = d.p.register_instance(d.run, "dying", 0, lease_seconds=2.0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)

    def lapse():  # the route already runs (its lease check passed); now the lease runs out
        wait_for(
            lambda: d.scalars("SELECT lease_expires_at <= now() FROM instances WHERE id = :i", i=inst)[0],
            "the lease to lapse",
        )

    (routed,), expired = _race_route_against(d, engine, inst, s, lambda: d.p.expire_instances(d.run), lapse)
    assert expired == [inst]
    assert running_on_fenced(d) == []
    assert d.sample(s)[0] == "queued"


def test_the_sweep_requeues_samples_on_any_fenced_instance(engine):
    """A straggler (running on an instance fenced earlier) goes back to the queue with its
    tokens at the next sweep, even though that sweep expires nothing new."""
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    inst = d.p.register_instance(d.run, "gone", 0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    att = d.routed([s], inst)
    d.p.report(d.run, [Report(s, att[s], 0, [4, 5], [-0.4, -0.5], SegmentKind.PARTIAL, **d.route_identity(s))])
    with engine.begin() as c:  # as the race above left it before the fix
        c.execute(text("UPDATE instances SET state = 'expired' WHERE id = :i"), {"i": inst})
    assert d.p.expire_instances(d.run) == []
    assert d.sample(s)[:4] == ("queued", 0, att[s], 2)
    assert running_on_fenced(d) == []
    assert d.scalars("SELECT data->>'why' FROM events WHERE kind = 'sample_requeued' AND sample_id = :s", s=s) == [
        "instance_expired"
    ]


# ---- item 6: overlapping heartbeats ---------------------------------------------------------


def test_overlapping_heartbeats_never_move_the_version_backwards(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    groups = d.enqueue(2)
    d.complete([m for g in groups for m in d.members(g)], inst)
    d.train(0)
    d.train(1)
    with ThreadPoolExecutor(1) as pool, engine.connect() as newer:
        newer.begin()  # a heartbeat at version 2, not committed yet
        newer.execute(
            text("UPDATE instances SET version = 2, lease_expires_at = now() + interval '30 s' WHERE id = :i"),
            {"i": inst},
        )
        older = pool.submit(d.p.heartbeat, inst, 1)  # read version 0 <= 1 before the newer one commits
        wait_for(lambda: lock_waiters(engine) == 1, "the older heartbeat to wait on the row")
        newer.commit()
        with pytest.raises(InvalidInput, match="version 1 outside 2"):
            older.result()
    assert d.scalars("SELECT version FROM instances WHERE id = :i", i=inst) == [2]
    d.p.heartbeat(inst, 2)  # the same version again is fine
    with pytest.raises(InvalidInput):
        d.p.heartbeat(inst, 1)


# ---- item 8: the lease is enforced by time, before any sweep --------------------------------


def test_a_lapsed_lease_is_fenced_everywhere_before_the_sweep(engine):
    d = Driver(engine, batch_size=2, group_size=1, eta=0)
    inst = d.p.register_instance(d.run, "stalled", 0)
    g1, g2 = d.enqueue(2)
    (s1,), (s2,) = d.members(g1), d.members(g2)
    att = d.routed([s1], inst)
    identity = d.route_identity(s1)
    assert d.p.interrupt(d.run, [s1]) == 1  # a command waiting for delivery
    with engine.begin() as c:  # the lease runs out; nobody has run the sweep
        c.execute(text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"), {"i": inst})
    before = segments(d)

    assert [r.outcome for r in d.route([s2], inst)] == [RouteOutcome.INSTANCE_INACTIVE]  # route to it
    assert d.sample(s2)[0] == "queued"
    with pytest.raises(Conflict, match="lease expired"):  # poll: neither work nor commands
        d.p.poll_work(inst)
    assert d.scalars("SELECT count(*) FROM commands WHERE state = 'pending'") == [1]
    with pytest.raises(Conflict, match="lease expired"):  # report from it
        d.p.report(d.run, [Report(s1, att[s1], 0, [9], [-0.9], **identity)])
    with pytest.raises(Conflict, match="lease expired"):  # heartbeat cannot revive it
        d.p.heartbeat(inst, 0)
    assert segments(d) == before
    assert inst not in [i.id for i in d.p.snapshot(d.run).instances]

    assert d.p.expire_instances(d.run) == [inst]  # the sweep only tidies up
    assert d.sample(s1)[0] == "queued" and running_on_fenced(d) == []


# ---- item 9: reports name their instance and quote an unguessable route token--------------------


def test_a_report_must_come_from_the_instance_holding_the_lease(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    a, b = d.p.register_instance(d.run, "a", 0), d.p.register_instance(d.run, "b", 0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    (routed,) = d.route([s], a)
    (work,) = d.p.poll_work(a).work
    assert work.route_token == routed.route_token and uuid.UUID(work.route_token).version == 4  # 122 random bits
    forged = [
        dict(instance_id=b, route_token=work.route_token),  # another instance, even with the token
        dict(instance_id=a, route_token=str(uuid.uuid4())),  # the right instance, a guessed token
    ]
    for ident in forged:
        with pytest.raises(Conflict, match="route lost"):
            d.p.report(d.run, [Report(s, work.attempt, 0, [1], [-1.0], **ident)])
    assert segments(d) == [] and d.sample(s)[0] == "running"
    d.p.report(d.run, [Report(s, work.attempt, 0, [1], [-1.0], instance_id=a, route_token=work.route_token)])
    assert segments(d) == [(s, 0, a, work.attempt, [1])]


@pytest.mark.db
def test_over_http_another_rollout_token_cannot_report_a_sample_routed_elsewhere(db_url, engine):
    """A second rollout token of the same run gets 409 reporting through its own instance (which
    does not hold the route) and 403 through the routed one (it belongs to another token), and
    changes nothing; the old path without the instance is 410."""
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    with ApiServer(db_url) as server:
        coord = server.client(token(db_url, "coordinator", d.run))
        mine, theirs = (server.client(token(db_url, "rollout", d.run)) for _ in range(2))
        a = mine.register(d.run, "a", 0).instance_id
        b = theirs.register(d.run, "b", 0).instance_id
        assert [r.outcome for r in coord.route(d.run, [(s, a)])] == ["routed"]
        (work,) = mine.poll(d.run, a, wait=5).work
        guess = {"sample_id": s, "attempt": work.attempt, "version": 0, "tokens": [6], "logprobs": [-0.6]}

        r = theirs.http.post(f"/v1/runs/{d.run}/segments", json={"reports": [guess]})  # as observed before the fix
        assert r.status_code == 410 and "/instances/" in r.json()["error"]["message"], r.text
        for inst, guessed in [(b, str(uuid.uuid4())), (b, work.route_token)]:
            with pytest.raises(ApiConflict) as refused:
                theirs.report(d.run, inst, [{**guess, "route_token": guessed}])
            assert refused.value.status == 409 and [i["id"] for i in refused.value.items] == [s]
        for guessed in (str(uuid.uuid4()), work.route_token):
            with pytest.raises(ApiForbidden) as refused:
                theirs.report(d.run, a, [{**guess, "route_token": guessed}])
            assert refused.value.status == 403 and "belongs to another token" in refused.value.message
        assert segments(d) == [] and d.sample(s)[0] == "running" and d.sample(s)[5] == a

        assert mine.report(d.run, a, [{**guess, "route_token": work.route_token}]) == 1
        assert segments(d) == [(s, 0, a, work.attempt, [6])]


@pytest.mark.db
def test_over_http_a_lapsed_instance_gets_409_and_registers_again(db_url, engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    with ApiServer(db_url) as server:
        coord = server.client(token(db_url, "coordinator", d.run))
        rollout = server.client(token(db_url, "rollout", d.run))
        inst = rollout.register(d.run, "slow", 0).instance_id
        coord.route(d.run, [(s, inst)])
        (work,) = rollout.poll(d.run, inst, wait=5).work
        with engine.begin() as c:
            c.execute(text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"), {"i": inst})
        item = {
            "sample_id": s,
            "attempt": work.attempt,
            "route_token": work.route_token,
            "version": 0,
            "tokens": [1],
            "logprobs": [-1.0],
        }
        for call in (
            lambda: rollout.poll(d.run, inst, wait=0),
            lambda: rollout.report(d.run, inst, [item]),
            lambda: rollout.heartbeat(d.run, inst, 0),
        ):
            with pytest.raises(ApiConflict) as refused:
                call()
            assert refused.value.status == 409
        assert [r.outcome for r in coord.route(d.run, [(s, inst)])] == ["not_queued"]
        assert coord.expire_instances(d.run) == [inst]
        again = rollout.register(d.run, "slow", 0).instance_id
        assert [r.outcome for r in coord.route(d.run, [(s, again)])] == ["routed"]
        (work,) = rollout.poll(d.run, again, wait=5).work
        assert rollout.report(d.run, again, [{**item, "attempt": work.attempt, "route_token": work.route_token}]) == 1
    assert segments(d) == [(s, 0, again, work.attempt, [1])]
