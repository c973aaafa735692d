"""A node long-poll's idle re-check through the API (in process, on a real database): while
every polled instance would answer empty, `POST …/instances/sync` with `poll` answers the empty
deliveries from one read sent in autocommit (`node_poll_idle`), no transaction and no key lock;
work routed to any one instance, a command pending for one, a lease renewal due or a fenced
instance send it through the transaction as before, and a keyed retry still replays. A long-poll
(node or single instance) woken by its instance's topic goes to the transaction without a second
idle read."""

from __future__ import annotations

import threading
import time

import pytest
from api_helpers import in_process
from sqlalchemy import text
from statement_recorder import sent_with_autocommit as sent

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig

pytestmark = pytest.mark.db

LEASE = 60.0
IDLE_MARK = "bool_and(i.id IS NOT NULL"  # node_poll_idle's


def test_an_idle_node_poll_is_one_read_without_a_transaction(db_url, engine):
    p = Protocol(engine)
    run = p.create_run("node-idle", RunConfig(batch_size=3, group_size=1, eta=1))
    p.enqueue(run, [Prompt(f"p{k}", [1, 2, 3]) for k in range(3)])
    auth = {"Authorization": f"Bearer {create_token(engine, 'rollout', run)['token']}"}
    with in_process(db_url) as http:
        app_engine = http.app.state.staleflow.engine
        register = {"version": 0, "lease_seconds": LEASE}
        iids = [
            http.post(f"/v1/runs/{run}/instances", json={"name": f"i{k}"} | register, headers=auth).json()[
                "instance_id"
            ]
            for k in range(3)
        ]
        a, b, c = iids

        def sync(key: str | None = None) -> tuple[list[dict], bool]:
            """The deliveries, and whether the poll ran a transaction."""
            headers = auth | ({"Idempotency-Key": key} if key else {})
            with sent(app_engine) as statements:
                r = http.post(
                    f"/v1/runs/{run}/instances/sync", params={"wait": 0}, json={"poll": iids}, headers=headers
                )
            assert r.status_code == 200, r.text
            assert any(IDLE_MARK in s and auto for s, auto in statements)  # the check comes first, in autocommit
            return r.json()["deliveries"], any(not auto for _, auto in statements)

        def empty(deliveries: list[dict]) -> bool:
            return [(x["instance_id"], x["status"], x["work"], x["commands"]) for x in deliveries] == [
                (i, 200, [], []) for i in iids
            ]

        sync()  # the token and the instances' owners cached
        got, transaction = sync()
        assert empty(got) and not transaction
        got, transaction = sync("never-used")
        assert empty(got) and not transaction

        queued = p.snapshot(run).queued
        p.route(run, [(queued[0].sample_id, c)])  # work for one of them
        got, transaction = sync("k1")
        assert transaction and [len(x["work"]) for x in got] == [0, 0, 1]
        again, transaction = sync("k1")  # a retry after a lost response replays the delivery
        assert transaction and again == got
        assert sync() == (again[:2] + [dict(again[2], work=[])], False)

        assert p.interrupt(run, [queued[0].sample_id]) == 1  # a command for one of them
        got, transaction = sync()
        assert transaction and [len(x["commands"]) for x in got] == [0, 0, 1]
        assert not sync()[1]

        with engine.begin() as conn:  # a quarter of b's lease gone: the poll renews it
            conn.execute(
                text("UPDATE instances SET lease_expires_at = now() + interval '40 s' WHERE id = :i"), {"i": b}
            )
        got, transaction = sync()
        assert empty(got) and transaction
        got, transaction = sync()
        assert empty(got) and not transaction

        with engine.begin() as conn:  # a's lease lapsed: its delivery is a 409, every time
            conn.execute(text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"), {"i": a})
        for _ in range(2):
            got, transaction = sync()
            assert transaction and [x["status"] for x in got] == [409, 200, 200]


@pytest.mark.parametrize("endpoint", ["node", "instance"])
def test_a_long_poll_woken_by_its_instances_topic_goes_straight_to_its_transaction(db_url, engine, endpoint):
    """A long-poll reads idle once on arrival; the wake a route publishes for its instance
    says there is something to deliver, so the re-check after it is the transaction alone."""
    p = Protocol(engine)
    run = p.create_run(f"woken-{endpoint}", RunConfig(batch_size=2, group_size=1, eta=1))
    p.enqueue(run, [Prompt(f"p{k}", [1, 2, 3]) for k in range(2)])
    rollout = {"Authorization": f"Bearer {create_token(engine, 'rollout', run)['token']}"}
    coordinator = {"Authorization": f"Bearer {create_token(engine, 'coordinator', run)['token']}"}
    with in_process(db_url) as http:
        app_engine = http.app.state.staleflow.engine
        register = {"version": 0, "lease_seconds": LEASE}
        iid = http.post(f"/v1/runs/{run}/instances", json={"name": "i"} | register, headers=rollout).json()[
            "instance_id"
        ]
        if endpoint == "node":
            url, body, idle_mark = f"/v1/runs/{run}/instances/sync", {"poll": [iid]}, IDLE_MARK
        else:
            url, body, idle_mark = f"/v1/runs/{run}/instances/{iid}/poll", None, "AND NOT delivered)"
        assert http.post(url, params={"wait": 0}, json=body, headers=rollout).status_code == 200  # owners cached
        got: list = []
        with sent(app_engine) as statements:
            poll = threading.Thread(
                target=lambda: got.append(http.post(url, params={"wait": 20}, json=body, headers=rollout))
            )
            poll.start()
            deadline = time.monotonic() + 20
            while not any(idle_mark in s for s, _ in list(statements)):  # parked after its first read
                assert time.monotonic() < deadline, "the long-poll never read"
                time.sleep(0.01)
            time.sleep(0.1)
            sid = p.snapshot(run).queued[0].sample_id
            routed = http.post(
                f"/v1/runs/{run}/routes", json={"routes": [{"sample_id": sid, "instance_id": iid}]}, headers=coordinator
            )
            assert routed.status_code == 200, routed.text
            poll.join(20)
        (r,) = got
        assert r.status_code == 200, r.text
        work = r.json()["deliveries"][0]["work"] if endpoint == "node" else r.json()["work"]
        assert [w["sample_id"] for w in work] == [sid]
        idle_reads = [s for s, auto in statements if idle_mark in s]
        assert len(idle_reads) == 1 and all(auto for s, auto in statements if idle_mark in s)
