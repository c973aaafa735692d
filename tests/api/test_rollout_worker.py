"""The rollout worker with the real torch engine, over real HTTP to a real API process:
routed samples are generated and reported; an interrupted sample continues elsewhere and its
tokens are exactly those of an uninterrupted run; a pull loads new weights; a worker whose
lease lapsed registers again."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from api_helpers import ApiServer, TickCountingWorker, token
from sqlalchemy import text

from staleflow_db.db import make_engine
from staleflow_db.payloads import unpack_logprobs, unpack_tokens
from workers.models.tiny_model import TinyConfig
from workers.rollout.engines.base import FinishedEvent
from workers.rollout.engines.torch_engine import TorchEngine
from workers.rollout.node import Node
from workers.rollout.worker import RolloutWorker

CFG = TinyConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, max_seq=512)
MAX_RESPONSE = 400


def _engine(**kw):
    return TorchEngine(CFG, model_seed=0, kv_capacity_tokens=8192, **kw)


def _wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


@pytest.fixture
def served(db_url):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("rollout", batch_size=6, group_size=2, eta=1, max_response_tokens=MAX_RESPONSE).id
        yield server, admin, run


def _start(worker):
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    _wait(lambda: worker.instance_id is not None)
    return t


def _rows(db_url, sql, **params):
    eng = make_engine(db_url)
    try:
        with eng.connect() as c:
            return c.execute(text(sql), params).all()
    finally:
        eng.dispose()


def _instance_state(db_url, instance_id):
    return _rows(db_url, "SELECT state FROM instances WHERE id = :i", i=instance_id)[0].state


def _segments(db_url, sample_id):
    sql = "SELECT instance_id, version, token_ids, logprobs FROM segments WHERE sample_id = :s ORDER BY seq"
    return _rows(db_url, sql, s=sample_id)


def _uninterrupted(prompt, sample_id, max_new):
    ref = _engine()
    ref.add_request(str(sample_id), prompt, max_new_tokens=max_new, seed=sample_id)
    while ref.has_work():
        for e in ref.step():
            if isinstance(e, FinishedEvent):
                return e.tokens, e.logprobs


def test_worker_generates_reports_and_continues_interrupted_samples(served):
    server, admin, run = served
    admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(6)])
    rollout = token(server.db_url, "rollout", run)
    a = RolloutWorker(server.client(rollout), run, _engine(), name="a", heartbeat_s=0.2, checkpoint_every_s=0.05)
    b = RolloutWorker(server.client(rollout), run, _engine(), name="b", heartbeat_s=0.2)
    ta, tb = _start(a), _start(b)
    queued = {q.sample_id: q for q in admin.snapshot(run).queued}
    prompts = {sid: [1, 2, 3 + (i // 2)] for i, sid in enumerate(sorted(queued))}
    # Generation is deterministic: interrupt the sample with the longest answer, mid-way.
    expected = {sid: _uninterrupted(prompts[sid], sid, MAX_RESPONSE) for sid in queued}
    victim = max(expected, key=lambda s: len(expected[s][0]))
    assert len(expected[victim][0]) >= 300  # hundreds of decode steps: the interrupt lands mid-way
    admin.route(run, [(victim, a.instance_id)])
    _wait(lambda: a.stats.tokens > 0)
    admin.interrupt(run, [victim])
    _wait(lambda: a.stats.interrupted == 1)
    # The worker counts the interrupt when it queues the report; route only once the server has it.
    _wait(lambda: victim in {q.sample_id for q in admin.snapshot(run).queued})
    routed = admin.route(run, [(victim, b.instance_id)] + [(s, a.instance_id) for s in queued if s != victim])
    assert {r.outcome for r in routed} == {"routed"}, routed
    _wait(lambda: a.stats.finished + b.stats.finished == 12)
    a.stop(), b.stop()
    ta.join(30), tb.join(30)
    assert a.stats.lost == b.stats.lost == 0
    segs = _segments(server.db_url, victim)
    tokens, logprobs = expected[victim]
    assert [t for s in segs for t in unpack_tokens(s.token_ids)] == tokens
    assert [lp for s in segs for lp in unpack_logprobs(s.logprobs)] == pytest.approx(logprobs, abs=1e-4)
    assert {s.instance_id for s in segs} == {a.instance_id, b.instance_id}
    assert len(admin.claim(run, limit=100, wait=0)) == 12  # every sample finished, ready for reward


def test_pull_command_loads_new_weights(served):
    server, admin, run = served
    new_model = _engine(version=0)
    with torch.no_grad():
        for p in new_model.model.parameters():
            p.add_(0.5)
    pulled = []

    def weights(target):
        pulled.append(target)
        return new_model.model.state_dict(), 0 if target is None else target

    worker = RolloutWorker(
        server.client(token(server.db_url, "rollout", run)), run, _engine(), weights=weights, heartbeat_s=0.2
    )
    t = _start(worker)
    admin.pull(run, [worker.instance_id], target_version=0)
    _wait(lambda: pulled == [0])
    worker.stop()
    t.join(30)
    assert worker.stats.pulls == 0  # version 0 is not newer than what it runs: nothing loaded


def test_checkpoints_and_finish_in_one_report_window_are_one_report(served):
    """Partial checkpoints that are still unsent when the sample finishes merge into its final
    segment: a batch never names a sample twice (the API would refuse it)."""
    server, admin, run = served
    admin.enqueue(run, [(f"q{i}", [1, 2, 3 + i]) for i in range(2)])
    w = RolloutWorker(
        server.client(token(server.db_url, "rollout", run)),
        run,
        _engine(),
        name="m",
        checkpoint_every_s=0.0001,
        report_every_s=0.5,
        heartbeat_s=0.2,
    )
    t = _start(w)
    admin.route(run, [(q.sample_id, w.instance_id) for q in admin.snapshot(run).queued])
    _wait(lambda: w.stats.finished == 4)
    w.stop()
    t.join(30)
    assert w.stats.lost == 0
    assert len(admin.claim(run, limit=100, wait=0)) == 4


@pytest.mark.parametrize("report_every_s", [0.05, 3.0])
def test_a_checkpoint_is_due_after_its_tokens_not_its_clock(served, report_every_s):
    """With a token bound and no time bound, a long sample is checkpointed every
    `checkpoint_tokens` of its decode (80% of it when a report goes anyway): its partial
    segments each carry about that many tokens, whatever the decode rate, and together with the
    finishing one they are the uninterrupted answer. Checkpoints that wait for the report timer
    (3 s: several fall due before it) stay segments of their own, never one grown past the bound."""
    server, admin, run = served
    admin.enqueue(run, [(f"c{i}", [1, 2, 3 + i]) for i in range(3)])
    queued = sorted(q.sample_id for q in admin.snapshot(run).queued)
    expected = {sid: _uninterrupted([1, 2, 3 + i // 2], sid, MAX_RESPONSE) for i, sid in enumerate(queued)}
    longest = max(expected, key=lambda s: len(expected[s][0]))
    assert len(expected[longest][0]) >= 300
    k = 64
    w = RolloutWorker(
        server.client(token(server.db_url, "rollout", run)),
        run,
        _engine(),
        name="tokens",
        checkpoint_tokens=k,
        checkpoint_every_s=0,
        heartbeat_s=0.2,
        report_every_s=report_every_s,
    )
    t = _start(w)
    admin.route(run, [(longest, w.instance_id)])
    _wait(lambda: w.stats.finished == 1)
    w.stop()
    t.join(30)
    segs = _segments(server.db_url, longest)
    sizes = [len(unpack_tokens(s.token_ids)) for s in segs]
    assert len(segs) >= len(expected[longest][0]) // k  # checkpointed as it decoded, not once at the end
    assert all(0.8 * k <= n <= k for n in sizes[:-1]), sizes
    assert [tok for s in segs for tok in unpack_tokens(s.token_ids)] == expected[longest][0]


def _finish_transactions(db_url, sample_ids):
    """The transaction that wrote each sample's finishing segment (segments are append-only)."""
    sql = "SELECT sample_id, xmin::text FROM segments WHERE sample_id = ANY(:s) AND finish_reason IS NOT NULL"
    return {sid: xid for sid, xid in _rows(db_url, sql, s=list(sample_ids))}


@pytest.mark.parametrize(
    ("on_node", "share", "most_s", "together"),
    [
        (False, 0.0, 30.0, False),  # no slack: each finish at the report timer
        (False, None, 30.0, True),  # the first waits for the second
        (False, None, 0.0, False),  # the cap bounds the wait
        (True, None, 30.0, True),  # on a node: another instance's finish shares the flush
    ],
)
def test_a_finish_waits_for_company_within_its_slack(served, on_node, share, most_s, together):
    """A finished sample's report waits at most `finish_slack_share` of its stretch's time and at
    most `finish_slack_max_s`: two samples decoding together, the shorter finishing well before
    the longer, go in one call (one transaction) when the shorter's slack outlasts the gap, and
    in two when either bound is 0. On a node the two run on two instances: one flush, one
    transaction."""
    server, admin, run = served
    admin.enqueue(run, [(f"f{i}", [1, 2, 3 + i]) for i in range(3)])
    queued = sorted(q.sample_id for q in admin.snapshot(run).queued)
    length = {sid: len(_uninterrupted([1, 2, 3 + i // 2], sid, MAX_RESPONSE)[0]) for i, sid in enumerate(queued)}
    short, long = min(length, key=length.get), max(length, key=length.get)
    assert length[long] - length[short] >= 100  # a gap of 100+ decode steps: far more than the report timer
    # the short one's slack outlasts the long one's decode several times over
    share = 3 * length[long] / length[short] if share is None else share
    client = server.client(token(server.db_url, "rollout", run))
    node = Node(client, run, poll_wait_s=1.0) if on_node else None
    workers = [
        RolloutWorker(
            client,
            run,
            _engine(),
            name=f"s{k}",
            finish_slack_share=share,
            finish_slack_max_s=most_s,
            node=node,
        )
        for k in range(2 if on_node else 1)
    ]
    if node is not None:
        node.start()
    threads = [_start(w) for w in workers]
    admin.route(run, [(short, workers[0].instance_id), (long, workers[-1].instance_id)])
    _wait(lambda: sum(w.stats.finished for w in workers) == 2 and not any(w.pending for w in workers))
    for w, t in zip(workers, threads, strict=True):
        w.stop()
        t.join(30)
    if node is not None:
        node.close()
    xids = _finish_transactions(server.db_url, [short, long])
    assert len(xids) == 2
    assert (xids[short] == xids[long]) is together, xids
    waited = sum(w.stats.finish_wait_s for w in workers)
    if not together:  # each went at once: no slack to wait out
        assert waited < 1.0, waited


def test_a_stopped_worker_does_not_wait_out_its_long_poll(served):
    """An idle worker stopped while its inbox long-polls (30 s, the server's cap) deregisters,
    which answers that poll at once: the worker's run ends long before the poll's wait would."""
    server, admin, run = served
    w = RolloutWorker(server.client(token(server.db_url, "rollout", run)), run, _engine(), name="idle", poll_wait_s=30)
    t = _start(w)
    _wait(lambda: w._inbox is not None and w._inbox.last_poll > 0)
    time.sleep(0.5)  # the poll is at the server, waiting
    w.stop()
    t.join(15)
    assert not t.is_alive()
    assert _instance_state(server.db_url, w.instance_id) == "deregistered"


def test_a_worker_whose_lease_lapsed_registers_again_and_keeps_serving(served):
    """A stalled worker's lease lapses; its next poll is refused (409) before any sweep, and the
    worker starts over as a new instance instead of dying."""
    server, admin, run = served
    admin.enqueue(run, [("late", [1, 2, 3])])
    w = RolloutWorker(
        server.client(token(server.db_url, "rollout", run)),
        run,
        _engine(),
        name="stalled",
        heartbeat_s=3600,
        idle_wait_s=0.1,
    )  # only its polls can notice
    t = _start(w)
    first = w.instance_id
    eng = make_engine(server.db_url)
    try:
        with eng.begin() as c:
            c.execute(
                text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"), {"i": first}
            )
    finally:
        eng.dispose()
    _wait(lambda: w.instance_id != first)
    assert admin.expire_instances(run) == [first]
    admin.route(run, [(q.sample_id, w.instance_id) for q in admin.snapshot(run).queued])
    _wait(lambda: w.stats.finished == 2)
    assert t.is_alive()
    w.stop()
    t.join(30)


def test_an_idle_worker_waits_instead_of_spinning(served):
    """With nothing to run and nothing changed, a heartbeat past its interval is not sent, and
    the loop waits for a delivery or `idle_wait_s`: not a tick a millisecond."""
    server, admin, run = served
    w = TickCountingWorker(
        server.client(token(server.db_url, "rollout", run)), run, _engine(), name="idle", heartbeat_s=0.2
    )
    t = _start(w)
    time.sleep(3.0)  # 15 heartbeat intervals, 3 idle waits
    ticks = w.ticks
    w.stop()
    t.join(30)
    assert ticks < 40, ticks
