"""Group commit over real HTTP and a real database: a burst of heartbeats, segment reports and
rewards (valid ones, a lapsed instance's, bad input, a stale claim, a request id's replay and
its reuse) applied in ONE transaction gives every caller the status and body its own
transaction gives with coalescing off, and leaves the same rows; a group whose backend is
killed mid-batch (after some of its items were applied, before it committed) gives every
caller a 503 and leaves nothing of any of them, and their retries then apply each once.

The group is made deterministic without timing: a row lock of the test's own holds a first
group (a heartbeat) in flight while the burst queues behind it (`staleflow_group_commit_queued`
says when all of it has), so the burst is one group when the lock goes (one lane: one group in
flight at a time)."""

from __future__ import annotations

import threading

import pytest

from tests.api_helpers import ApiServer
from tests.group_commit_helpers import (
    Call,
    RowLock,
    Scene,
    api_backends_waiting,
    build,
    burst,
    metric,
    wait_for,
)
from tests.node_kill_helpers import terminate

pytestmark = [pytest.mark.db, pytest.mark.slow]

QUEUED = "staleflow_group_commit_queued"
CALLS = "staleflow_group_commit_transaction_calls"

EXPECTED = {
    **{f"hb_A{i}": 200 for i in range(4)},
    "hb_lapsed": 409,
    "hb_bad_version": 422,
    **{f"rep_s{i}": 200 for i in range(4)},
    "rep_same_key_twice": 200,
    "rep_lapsed": 409,
    "rep_bad_version": 422,
    "rep_bad_token": 409,
    "rep_replay": 200,
    "rep_key_reused": 409,
    "rw_w0": 200,
    "rw_w1": 200,
    "rw_stale_claim": 409,
    "rw_unknown_sample": 404,
    "rw_not_finite": 422,
}


def _plug(sc: Scene, url: str, db_url: str) -> tuple[RowLock, threading.Thread, dict[str, tuple[int, object]]]:
    """A heartbeat of the plug instance, held in flight on the test's row lock."""
    lock = RowLock(db_url, sc.instances["P"])
    got: dict[str, tuple[int, object]] = {}
    t = threading.Thread(
        target=lambda: got.update(plug=sc.post(Call("plug", sc.path("P", "heartbeat"), {"version": 0})))
    )
    t.start()
    wait_for(lambda: metric(url, QUEUED) == 1 and api_backends_waiting(db_url), "the plug's group in flight")
    return lock, t, got


def test_each_caller_in_a_group_gets_what_its_own_transaction_gives(db_url, engine):
    with ApiServer(db_url, STALEFLOW_API_GROUP_COMMIT="false") as plain:
        sc, calls = build(engine, plain.url, "plain", 10_000)
        assert sc.post(Call("plug", sc.path("P", "heartbeat"), {"version": 0}))[0] == 200
        threads, alone = burst(sc, calls)
        for t in threads:
            t.join()
        alone_state = sc.state()
        assert metric(plain.url, CALLS + "_count") == 0  # nothing went through a group
    assert {k: v[0] for k, v in alone.items()} == EXPECTED, alone

    with ApiServer(db_url, STALEFLOW_API_GROUP_COMMIT="true", STALEFLOW_API_GROUP_COMMIT_LANES="1") as server:
        gc, gcalls = build(engine, server.url, "grouped", 20_000)
        count0, sum0 = metric(server.url, CALLS + "_count"), metric(server.url, CALLS + "_sum")
        lock, plug, plugged = _plug(gc, server.url, db_url)
        threads, grouped = burst(gc, gcalls)
        n = sum(c.reaches_group for c in gcalls)
        wait_for(lambda: metric(server.url, QUEUED) == 1 + n, "the burst queued behind the plug")
        lock.release()
        for t in [plug, *threads]:
            t.join()
        assert plugged["plug"][0] == 200
        # two transactions: the plug's, then the whole burst's
        assert metric(server.url, CALLS + "_count") - count0 == 2
        assert metric(server.url, CALLS + "_sum") - sum0 == 1 + n
        grouped_state = gc.state()

    assert {k: (s, gc.normalised(b)) for k, (s, b) in grouped.items()} == {
        k: (s, sc.normalised(b)) for k, (s, b) in alone.items()
    }
    assert grouped_state == alone_state


def test_a_group_killed_mid_batch_applies_nothing_and_its_retries_apply_once(db_url, engine):
    with ApiServer(db_url, STALEFLOW_API_GROUP_COMMIT="true", STALEFLOW_API_GROUP_COMMIT_LANES="1") as server:
        sc, calls = build(engine, server.url, "kills", 30_000)
        # the plug instance's own heartbeat: last in lock order, it waits on the row lock after
        # every other item of the group was applied in its savepoint
        calls = [c for c in calls if c.reaches_group] + [Call("hb_P", sc.path("P", "heartbeat"), {"version": 0})]
        before, leases = sc.state(), sc.leases()

        lock, plug, plugged = _plug(sc, server.url, db_url)
        ((first, _),) = api_backends_waiting(db_url)
        threads, outcomes = burst(sc, calls)
        wait_for(lambda: metric(server.url, QUEUED) == 1 + len(calls), "the burst queued behind the plug")
        terminate(db_url, first)  # the plug's group dies; the burst's group starts

        def mid_batch() -> bool:
            return any(pid != first and wrote for pid, wrote in api_backends_waiting(db_url))

        wait_for(mid_batch, "the burst's group waiting on the lock after writing")
        ((second, wrote),) = api_backends_waiting(db_url)
        assert wrote
        terminate(db_url, second)
        for t in [plug, *threads]:
            t.join()
        lock.release()

        for name, (status, body) in [("plug", plugged["plug"]), *outcomes.items()]:
            assert (status, body["error"]["code"]) == (503, "database_unavailable"), (name, body)
        assert sc.state() == before and sc.leases() == leases  # nothing of any item

        threads, retried = burst(sc, calls)  # every caller retries, with its request id
        for t in threads:
            t.join()
        assert {k: v[0] for k, v in retried.items()} == {c.name: EXPECTED.get(c.name, 200) for c in calls}, retried
        after = sc.state()["samples"]
        for i in range(4):
            assert after[f"s{i}"][:3] == ("finished", 2, 1)  # applied once (r0 posted twice)
        assert after["sP"][:3] == ("running", 1, 1)  # the replay added nothing
        assert after["w0"][0] != "scoring" and after["w1"][0] != "scoring" and after["w2"][0] == "scoring"
        assert after["sL"][2] == after["sV"][2] == after["sT"][2] == 0
