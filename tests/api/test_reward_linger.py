"""The reward worker's linger (workers/reward/worker.py, CLAIM_LINGER_S), through the API in
process on a real database: after a claim that took fewer samples than its batch the next
claim waits, so the samples that finish meanwhile come in one claim; a claim that took a whole
batch is followed at once; stopping the worker ends a linger."""

from __future__ import annotations

import threading
import time

import pytest
from api_helpers import in_process
from sqlalchemy import text

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig
from workers.client import StaleFlowClient
from workers.reward.sources import FunctionReward
from workers.reward.worker import RewardWorker

pytestmark = pytest.mark.db

GUARD_S = 60.0  # a hang's guard, never a timing assertion


class ClaimLog(StaleFlowClient):
    """The real client, each claim's start time and size noted."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.claims: list[tuple[float, int]] = []

    def claim(self, *a, **kw):
        started = time.monotonic()
        tasks = super().claim(*a, **kw)
        self.claims.append((started, len(tasks)))
        return tasks


def _routed_run(engine, groups: int) -> tuple[int, Protocol, int, list]:
    p = Protocol(engine)
    run = p.create_run(f"linger-{groups}-{time.monotonic_ns()}", RunConfig(batch_size=groups, group_size=2, eta=1))
    p.enqueue(run, [Prompt(f"p{k}", [1, 2, 3]) for k in range(groups)])
    inst = p.register_instance(run, "i", 0)
    with engine.connect() as c:
        ids = c.execute(text("SELECT id FROM samples WHERE run_id = :r ORDER BY id"), {"r": run}).scalars().all()
    return run, p, inst, p.route(run, [(s, inst) for s in ids])


def _finish(p: Protocol, run: int, inst: int, routes: list) -> float:
    p.report(
        run,
        [Report(r.sample_id, r.attempt, 0, [5], [-0.5], instance_id=inst, route_token=r.route_token) for r in routes],
    )
    return time.monotonic()


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _worker(http, engine, run: int, **kw) -> tuple[RewardWorker, ClaimLog, threading.Thread]:
    client = ClaimLog(http=http, token=create_token(engine, "reward", run)["token"], retry_for=None)
    worker = RewardWorker(client, run, FunctionReward(lambda s: float(s.sample_id % 2)), wait_s=0.2, **kw)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, client, thread


def test_after_a_partial_claim_the_next_claim_waits_and_gathers_what_finished(db_url, engine):
    linger = 2.0
    run, p, inst, routes = _routed_run(engine, 5)
    _finish(p, run, inst, routes[:1])
    with in_process(db_url) as http:
        worker, client, thread = _worker(http, engine, run, linger_s=linger)
        try:
            _until(lambda: worker.stats.scored == 1, "the first reward")
            finished_at = _finish(p, run, inst, routes[1:])
            _until(lambda: worker.stats.scored == 10, "the other nine rewards")
        finally:
            worker.stop()
            thread.join(GUARD_S)
    (first, n1), (second, n2) = client.claims[:2]
    assert n1 == 1
    assert second - first >= linger  # the linger, measured from the partial claim
    if finished_at < first + linger:  # (always, unless this machine stalled for seconds)
        assert n2 == 9 and sum(n for _, n in client.claims) == 10


def test_a_whole_batch_is_followed_at_once_and_stop_ends_a_linger(db_url, engine):
    run, p, inst, routes = _routed_run(engine, 5)
    _finish(p, run, inst, routes[:9])
    with in_process(db_url) as http:
        # a linger far longer than the guard: the test finishes only if no linger follows a whole batch
        worker, client, thread = _worker(http, engine, run, batch=3, linger_s=10 * GUARD_S)
        try:
            _until(lambda: worker.stats.scored == 9, "three whole batches")
            assert [n for _, n in client.claims[:3]] == [3, 3, 3]
            _finish(p, run, inst, routes[9:])
            _until(lambda: worker.stats.scored == 10, "the last reward")  # a partial claim: a linger starts
        finally:
            worker.stop()
            thread.join(GUARD_S)
        assert not thread.is_alive()  # stop() ended the linger
    assert [n for _, n in client.claims if n] == [3, 3, 3, 1]
