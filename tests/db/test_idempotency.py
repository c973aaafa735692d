"""One idempotency implementation (staleflow_db.idempotency) for the protocol's request ids
and the API's Idempotency-Key, and the transaction runner that retries deadlock victims:
real PostgreSQL, real threads, real HTTP."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_helpers import ApiServer, token
from protocol_helpers import Driver
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from staleflow_db import idempotency
from staleflow_db.errors import Conflict
from staleflow_db.idempotency import KeyReused
from staleflow_db.types import Report
from workers.wire.types import RouteOutcome

WAIT_S = 60  # guards against a hang, never a timing assertion


def _routed_sample(d: Driver) -> tuple[int, int]:
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    return s, inst


def _together(n: int, fn) -> list:
    """Run fn(i) in n threads released at once; results (or exceptions) in order."""
    barrier = threading.Barrier(n)

    def go(i):
        barrier.wait(WAIT_S)
        try:
            return fn(i)
        except Exception as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(go, range(n)))


def test_a_concurrent_duplicate_is_applied_once_and_answered_alike(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    s, inst = _routed_sample(d)
    routes = _together(4, lambda _: d.p.route(d.run, [(s, inst)], request_id="route-k"))
    assert not any(isinstance(r, Exception) for r in routes), routes
    assert all(r == routes[0] for r in routes) and routes[0][0].outcome == RouteOutcome.ROUTED
    assert d.sample(s)[2] == routes[0][0].attempt == 1  # routed once: one attempt
    rep = [Report(s, routes[0][0].attempt, 0, [3, 4], [-0.5, -0.25], **d.route_identity(s))]
    applied = _together(4, lambda _: d.p.report(d.run, rep, request_id="report-k"))
    assert applied == [1, 1, 1, 1]
    assert d.scalars("SELECT count(*) FROM segments") == [1]


def test_the_same_request_id_with_another_body_is_refused(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    s, inst = _routed_sample(d)
    (r,) = d.p.route(d.run, [(s, inst)], request_id="k")
    ident = d.route_identity(s)
    d.p.report(d.run, [Report(s, r.attempt, 0, [3], [-0.5], **ident)], request_id="rep")
    with pytest.raises(KeyReused, match="already used"):
        d.p.report(d.run, [Report(s, r.attempt, 0, [9], [-0.5], **ident)], request_id="rep")  # other tokens
    with pytest.raises(KeyReused):
        d.p.report(d.run, [Report(s, r.attempt, 0, [3], [-0.5], **ident)], request_id="k")  # another operation
    assert d.scalars("SELECT count(*) FROM segments") == [1]


def test_api_duplicate_requests_over_http(db_url, engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    s, inst = _routed_sample(d)
    with ApiServer(db_url) as server:
        headers = {"Authorization": f"Bearer {token(db_url, 'coordinator', d.run)}", "Idempotency-Key": "same"}
        url = f"{server.url}/v1/runs/{d.run}/routes"
        body = {"routes": [{"sample_id": s, "instance_id": inst}]}
        with httpx.Client(timeout=WAIT_S) as http:
            answers = _together(2, lambda _: http.post(url, json=body, headers=headers))
            assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
            assert answers[0].json() == answers[1].json()
            assert answers[0].json()["results"][0]["outcome"] == "routed"
            other = http.post(url, json={"routes": [{"sample_id": s, "instance_id": inst + 1}]}, headers=headers)
            assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert d.sample(s)[2] == 1  # one route applied


def test_a_deadlock_victim_is_retried_whole(engine):
    """Two transactions lock two rows in opposite orders: PostgreSQL aborts one (40P01); the
    runner runs it again and both commit, each exactly once."""
    with engine.begin() as c:
        c.execute(text("CREATE TABLE pair (id int PRIMARY KEY, n int NOT NULL)"))
        c.execute(text("INSERT INTO pair VALUES (1, 0), (2, 0)"))
        c.execute(
            text(
                "ALTER DATABASE "
                + c.execute(text("SELECT current_database()")).scalar()
                + " SET deadlock_timeout = '50ms'"
            )
        )
    engine.dispose()  # new sessions pick the short deadlock_timeout
    runs = [0, 0]
    both_locked = threading.Barrier(2)

    def body(i: int):
        def tx(conn):
            runs[i] += 1
            first, second = (1, 2) if i == 0 else (2, 1)
            conn.execute(text("UPDATE pair SET n = n + 1 WHERE id = :id"), {"id": first})
            if runs[i] == 1:
                both_locked.wait(WAIT_S)  # both hold their first row: a certain deadlock
            conn.execute(text("UPDATE pair SET n = n + 1 WHERE id = :id"), {"id": second})
            return i

        return idempotency.transaction(engine, tx)

    assert _together(2, body) == [0, 1]
    # Each deadlock aborts exactly one of the two, which runs again. The retry may take its first
    # row back before the survivor wakes and deadlock once more (then the other is the victim),
    # so the count of runs is 2 + the number of deadlocks, at least one.
    assert max(runs) >= 2 and min(runs) >= 1
    with engine.connect() as c:
        assert c.execute(text("SELECT n FROM pair ORDER BY id")).scalars().all() == [2, 2]


def test_claims_and_late_rewards_do_not_deadlock(engine):
    """Reward workers whose claims expire while they score (tiny claims) post rewards late,
    while others claim and so reset the expired claims: many threads on one run. Every
    record_rewards either applies or is refused with 409 (its claim was taken over); no
    deadlock reaches a caller, and every sample ends rewarded."""
    groups, n = 40, 2
    d = Driver(engine, batch_size=groups, group_size=n, eta=0, max_response_tokens=8)
    inst = d.p.register_instance(d.run, "i", 0)
    sids = [s for g in d.enqueue(groups) for s in d.members(g)]
    d.finish(d.routed(sids, inst))
    errors: list[BaseException] = []
    refused = [0]
    stop = time.monotonic() + WAIT_S

    def worker(i: int) -> None:
        while time.monotonic() < stop:
            left = d.scalars("SELECT count(*) FROM samples WHERE run_id = :r AND state <> 'rewarded'")[0]
            if not left:
                return
            try:
                tasks = d.p.claim_rewards(d.run, limit=7 + i, claim_seconds=0.001)
                if not tasks:
                    continue
                time.sleep(0.002)  # score: the claims expire meanwhile
                d.p.record_rewards(d.run, [(t.sample_id, t.reward_attempt, float(t.sample_id % 2)) for t in tasks])
            except Conflict:
                refused[0] += 1
            except DBAPIError as e:
                errors.append(e)
                return

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(worker, range(6)))
    assert errors == []
    assert d.scalars("SELECT count(*) FROM samples WHERE run_id = :r AND state = 'rewarded'") == [groups * n]
    assert d.scalars("SELECT count(*) FROM prompt_groups WHERE run_id = :r AND state = 'occupied'") == [groups]
    assert d.violations() == []


class _Conflict(Exception):
    sqlstate = "40001"  # serialization_failure, as psycopg's errors carry it


def test_the_runner_tries_as_often_as_its_policy_says():
    """The first try runs outside tenacity; a conflict counts as the policy's first attempt."""
    policy = idempotency.TRANSACTION_CONFLICT.but(initial=0.0, cap=0.0, attempts=3)
    calls = []

    def always_conflicts():
        calls.append(1)
        raise DBAPIError("UPDATE", {}, _Conflict(f"conflict {len(calls)}"))

    with pytest.raises(DBAPIError, match="conflict 3"):  # the last error, after 3 attempts in all
        idempotency.retried(always_conflicts, policy)
    assert len(calls) == 3

    def conflicts_once():
        calls.append(1)
        if len(calls) == 4:
            raise DBAPIError("UPDATE", {}, _Conflict("once"))
        return "done"

    assert idempotency.retried(conflicts_once, policy) == "done" and len(calls) == 5

    def refuses():
        calls.append(1)
        raise Conflict([(0, "not a transaction conflict")])

    with pytest.raises(Conflict):
        idempotency.retried(refuses, policy)
    assert len(calls) == 6  # not retried


@pytest.mark.parametrize("own_transaction", [True, False])
def test_an_outcome_stored_behind_the_locks_back_refuses_the_call_and_keeps_none_of_it(engine, own_transaction):
    """A writer that skips the key's lock stores an outcome between this call's lookup and its
    store: the store fails, and the call's writes go with it, its COMMIT sent in the store's
    round trip (a transaction of its own) or not (the caller's) alike."""
    key, marker = f"k-{own_transaction}", f"marker-{own_transaction}"

    def call(conn) -> int:
        conn.execute(
            text("INSERT INTO idempotency (request_id, operation, response) VALUES (:k, 'call', '{}')"), {"k": marker}
        )
        with engine.begin() as other:  # the lock-skipping writer, committed first
            other.execute(
                text("INSERT INTO idempotency (request_id, operation, response) VALUES (:k, 'x#d', '1')"), {"k": key}
            )
        return 7

    def once(conn=None):
        return idempotency.once(engine, key, "op", "d", call, str, int, conn=conn)

    with pytest.raises(KeyReused, match="used concurrently"):
        if own_transaction:
            once()
        else:
            with engine.begin() as conn:
                once(conn)
    with engine.connect() as c:
        kept = c.execute(
            text("SELECT request_id FROM idempotency WHERE request_id IN (:k, :m)"), {"k": key, "m": marker}
        )
        assert sorted(kept.scalars()) == [key]  # the other writer's outcome; the call left nothing
