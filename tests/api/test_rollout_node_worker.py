"""Three sim instances on one rollout node (workers/rollout/node.py), over real HTTP to a real
API process: their reports go in node syncs, one instance's lease lapses mid-run, its flush
item and delivery are refused (409) and it registers again, while the other two keep their
instances and go on finishing samples."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from api_helpers import ApiServer, TickCountingWorker, token
from sqlalchemy import text

from staleflow_db.db import make_engine
from workers.rollout.engines.sim_engine import SimEngine, encode_prompt
from workers.rollout.node import Node
from workers.rollout.worker import RolloutWorker


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not reached: {what}"
        time.sleep(0.05)


@contextmanager
def _serving(node: Node, workers: list[RolloutWorker]) -> Iterator[None]:
    """The node and its workers running, each worker in a thread; stopped and joined after."""
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    node.start()
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
        node.close()


@pytest.mark.slow
def test_a_lapsed_instance_of_a_node_registers_again_and_the_others_go_on(db_url):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("node", batch_size=60, group_size=1, eta=0, max_response_tokens=64).id
        admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(60)])
        client = server.client(token(db_url, "rollout", run))
        sent: list[str] = []
        client.http.event_hooks["request"].append(lambda r: sent.append(r.url.path.rsplit("/", 1)[-1]))
        node = Node(client, run, poll_wait_s=1.0)
        workers = [
            RolloutWorker(client, run, SimEngine(max_running=4, time_scale=0.2), name=f"n{k}", lease_s=10.0, node=node)
            for k in range(3)
        ]
        with _serving(node, workers):
            _wait(lambda: all(w.instance_id is not None for w in workers), "registered")
            first = [w.instance_id for w in workers]
            queued = [q.sample_id for q in admin.snapshot(run).queued]

            def route(k: int, n: int) -> None:
                nonlocal queued
                batch, queued = queued[:n], queued[n:]
                admin.route(run, [(s, workers[k].instance_id) for s in batch])

            for k in range(3):
                route(k, 4)
            _wait(lambda: all(w.stats.finished >= 4 for w in workers), "the first samples finished")
            # instance 1's lease lapses mid-run, with samples on it: its next flush item or poll is refused
            route(1, 4)
            _wait(lambda: workers[1].stats.routed >= 8, "delivered")
            engine = make_engine(db_url)
            try:
                with engine.begin() as c:
                    c.execute(
                        text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"),
                        {"i": first[1]},
                    )
            finally:
                engine.dispose()
            _wait(lambda: workers[1].instance_id != first[1], "instance 1 to register again")
            assert [workers[0].instance_id, workers[2].instance_id] == [first[0], first[2]]
            before = [w.stats.finished for w in workers]
            for k in range(3):
                route(k, 4)
            _wait(lambda: all(w.stats.finished >= b + 4 for w, b in zip(workers, before)), "all three go on")
            assert [workers[0].instance_id, workers[2].instance_id] == [first[0], first[2]]  # never fenced
            assert workers[0].stats.lost == workers[2].stats.lost == 0
            # every report, heartbeat and poll went through node syncs
            assert {"segments", "heartbeat", "poll"}.isdisjoint(sent) and "sync" in sent


def test_idle_instances_of_a_node_wait_instead_of_spinning(db_url):
    """With nothing routed, a node's instances tick on deliveries and `idle_wait_s`, not in a
    loop: a heartbeat past its interval with nothing to carry is not a reason to wake."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("idle-node", batch_size=2, group_size=1, eta=0, max_response_tokens=64).id
        client = server.client(token(db_url, "rollout", run))
        node = Node(client, run, poll_wait_s=1.0)
        workers = [
            TickCountingWorker(client, run, SimEngine(max_running=4), name=f"i{k}", heartbeat_s=0.2, node=node)
            for k in range(2)
        ]
        with _serving(node, workers):
            _wait(lambda: all(w.instance_id is not None for w in workers), "registered")
            time.sleep(3.0)  # 15 heartbeat intervals
            ticks = [w.ticks for w in workers]
        assert max(ticks) < 60, ticks


def test_an_idle_instance_waits_for_its_nodes_report_timer(db_url):
    """A report pending on an idle instance goes at the node's report timer (here 2 s); the
    instance meanwhile waits for that timer, not in a loop. The first sample's report starts
    the timer (the node's first flush goes at once); the second one's, routed right after,
    waits for it."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("node-timer", batch_size=2, group_size=1, eta=0, max_response_tokens=64).id
        admin.enqueue(run, [("p", [1, 2, 3]), ("q", [1, 2, 4])])
        client = server.client(token(db_url, "rollout", run))
        node = Node(client, run, report_every_s=2.0, poll_wait_s=1.0)
        worker = TickCountingWorker(client, run, SimEngine(max_running=4), name="t", heartbeat_s=0.2, node=node)
        with _serving(node, [worker]):
            _wait(lambda: worker.instance_id is not None, "registered")
            first, second = [q.sample_id for q in admin.snapshot(run).queued]
            admin.route(run, [(first, worker.instance_id)])
            _wait(lambda: worker.stats.finished == 1 and not worker.pending, "the first handed to a flush")
            start = worker.ticks
            admin.route(run, [(second, worker.instance_id)])
            _wait(lambda: worker.stats.finished == 2, "the second finished")
            _wait(lambda: not worker.pending, "the second handed to a flush")
            ticks = worker.ticks - start
        assert ticks < 200, ticks


def test_a_quiet_instances_snapshot_rides_the_other_instances_flushes(db_url):
    """An instance of a node that reports nothing for a while (one long sample decoding) sends
    its progress every `snapshot_every_s`; while the node's other instance flushes reports, that
    snapshot rides one of those flushes once 80% due, instead of a sync of its own when due.
    (Engine steps of 5 ms: each flush finds the quiet one within its gather window.)"""
    every = 2.0
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("ride", batch_size=121, group_size=1, eta=0, max_response_tokens=8192).id
        admin.enqueue(run, [("long", encode_prompt(8, 8000, 0.0))])
        admin.enqueue(run, [(f"s{i}", encode_prompt(8, 60, 0.3)) for i in range(120)])
        client = server.client(token(db_url, "rollout", run))
        node = Node(client, run, poll_wait_s=1.0)
        quiet, busy = [
            RolloutWorker(
                client,
                run,
                SimEngine(max_running=4, time_scale=0.4, max_step_s=0.005),
                name=name,
                heartbeat_s=0.2,
                snapshot_every_s=every,
                checkpoint_tokens=0,  # no checkpoints: the quiet one's progress goes only in snapshots
                checkpoint_every_s=0,
                node=node,
            )
            for name in ("quiet", "busy")
        ]
        beats: list[float] = []  # when a sync carried the quiet instance's heartbeat

        def seen(request) -> None:
            if request.url.path.endswith("/instances/sync") and request.content:
                items = json.loads(request.content).get("items", [])
                if any(i["instance_id"] == quiet.instance_id and i.get("heartbeat") for i in items):
                    beats.append(time.monotonic())

        client.http.event_hooks["request"].append(seen)
        with _serving(node, [quiet, busy]):
            _wait(lambda: quiet.instance_id is not None and busy.instance_id is not None, "registered")
            queued = sorted(admin.snapshot(run).queued, key=lambda q: q.sample_id)
            admin.route(run, [(queued[0].sample_id, quiet.instance_id)])
            admin.route(run, [(q.sample_id, busy.instance_id) for q in queued[1:]])
            _wait(lambda: busy.stats.finished == 120, "the busy instance's samples", timeout=120)
            done = time.monotonic()
            assert quiet.stats.finished == 0  # still decoding: it reported nothing all along
        gaps = [b - a for a, b in zip(beats, beats[1:]) if b <= done]
        assert len(gaps) >= 2, beats
        assert all(g < every for g in gaps), gaps  # rode a flush at 80%, never waited until due


def test_a_flush_waits_for_the_instances_mid_step(db_url):
    """A flush asks the node's other instances for what they have pending and waits for them to
    end the step they are in (as long as their last step took): with engine steps of ~60 ms,
    longer than `gather_s`, two busy instances' reports still go together in nearly every flush,
    not each in a flush of its own."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("gather", batch_size=160, group_size=1, eta=0, max_response_tokens=256).id
        admin.enqueue(run, [(f"g{i}", encode_prompt(8, 40, 0.3)) for i in range(160)])
        client = server.client(token(db_url, "rollout", run))
        node = Node(client, run, poll_wait_s=1.0)
        workers = [
            RolloutWorker(
                client, run, SimEngine(max_running=4, time_scale=0.5, max_step_s=0.06), name=f"g{k}", node=node
            )
            for k in range(2)
        ]
        carried: list[int] = []  # instances per flush

        def seen(request) -> None:
            if request.url.path.endswith("/instances/sync") and request.content:
                items = json.loads(request.content).get("items") or []
                if items:
                    carried.append(len(items))

        client.http.event_hooks["request"].append(seen)
        with _serving(node, workers):
            _wait(lambda: all(w.instance_id is not None for w in workers), "registered")
            queued = sorted(q.sample_id for q in admin.snapshot(run).queued)
            for k, w in enumerate(workers):
                admin.route(run, [(s, w.instance_id) for s in queued[k::2]])
            _wait(lambda: all(w.stats.finished == 80 for w in workers), "every sample finished", timeout=120)
        assert node.gather_s < 0.06 and len(carried) >= 10, carried
        assert sum(carried) / len(carried) >= 1.6, carried
