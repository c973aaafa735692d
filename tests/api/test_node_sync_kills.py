"""Node sync under backend kills, over real HTTP to a real API process and a real database:
the PostgreSQL backend serving a node's sync (several instances' reports and heartbeats in one
transaction) or its poll is terminated at a chosen point, and every caller's outcome is checked.

Where: in the folded statements (the instances written, the samples' locks awaited; or the
segments being written), in the per-item path a fenced item forces (one item applied under its
savepoint, a lapsed one refused, the next writing its segment), in a delivering node poll (the
leases renewed, the samples' locks awaited), and at the commit (committed and flushed, the
backend killed while it waits for a synchronous standby that never comes: the client is never
told). Each point is reached without timing: a row lock or an uncommitted row of the test's
own holds the transaction there, and the backend is found by what it waits on and holds.

What: the workers' own client (`StaleFlowClient.sync`, as workers/rollout/node.py sends its
flushes and polls) gets a 503 and retries under the same Idempotency-Key. Killed before the
commit, nothing of any item is left and the retry applies each once; killed at the commit, the
retry gets the stored outcomes back and nothing is applied twice. Every item's segments appear
at most once, a refused item refuses only itself, the audit stays empty; a delivering poll
killed either way loses no delivery."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from staleflow_db import migrate
from staleflow_db.embedded import EmbeddedPostgres
from tests.api_helpers import ApiServer
from tests.node_kill_helpers import (
    LEASE,
    WRITES,
    Call,
    Scene,
    blocked_by,
    commits_held,
    in_sync_rep,
    locks_held,
    sample_lock,
    scene,
    segment_slot,
    terminate,
    wait_for,
)

pytestmark = [pytest.mark.slow]  # the tests on db_url are marked db by conftest


def _outcomes(out) -> list[tuple[int, int, int]]:
    return [(r.instance_id, r.status, r.applied) for r in out.results]


def _retried_once(rec) -> str:
    """The client's attempts at the sync: a 503, then the answer, under one request id."""
    syncs = rec.syncs()
    assert [s for _, s in syncs] == [503, 200], syncs
    assert syncs[0][0] is not None and syncs[0][0] == syncs[1][0], syncs
    return syncs[0][0]


def _replayed(sc: Scene, body: dict, key: str, first) -> None:
    """Another retry under the key: the same body back, nothing applied again."""
    before = sc.state()
    r = httpx.post(
        f"{sc.server.url}/v1/runs/{sc.run}/instances/sync",
        json=body,
        headers={"Authorization": f"Bearer {sc.token}", "Idempotency-Key": key},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json() == first.model_dump(mode="json"), r.text
    assert sc.state() == before


def _applied_once(sc: Scene, names: list[str], refused: tuple[str, ...] = ()) -> None:
    """Each applied item's sample holds its one segment (2 tokens); a refused one's none."""
    samples = sc.state()["samples"]
    for n in names:
        state, _attempt, n_tokens, n_segments, _delivered, segments = samples[n]
        if n in refused:
            assert (n_tokens, n_segments, segments) == (0, 0, 0), (n, samples[n])
        else:
            assert (state, n_tokens, n_segments, segments) == ("running", 2, 1, 1), (n, samples[n])


@pytest.mark.parametrize("where", ["locks", "write"])
def test_a_kill_in_the_folded_statements_applies_nothing_and_the_retry_applies_once(db_url, where):
    with ApiServer(db_url) as server:
        sc = scene(server, db_url, "ABC", "ABC")
        items = [sc.item("A"), sc.item("B", heartbeat=True), sc.item("C")]
        before = sc.state()
        w = sc.works["C"]
        held = (
            sample_lock(db_url, w.sample_id)  # the last sample the folded path locks
            if where == "locks"
            else segment_slot(db_url, sc.run, w.sample_id, sc.iids["C"], w.attempt)  # the last segment it writes
        )
        rec = sc.recorded()
        call = Call(lambda: rec.client.sync(sc.run, items))
        first = blocked_by(db_url, held.pid)
        # in the folded statements: every instance written (their snapshots, B's heartbeat),
        # then awaiting the samples' locks (no segment written yet) or writing the segments
        assert first.wrote and (("instances", WRITES) in locks_held(db_url, first.pid))
        writing = ("segments", WRITES) in locks_held(db_url, first.pid)
        assert writing == (where == "write") and ("INSERT INTO segments" in first.query) == writing, first
        terminate(db_url, first.pid)
        blocked_by(db_url, held.pid, other_than=[first.pid])  # the client's retry, where the first was
        assert sc.state() == before  # nothing of any item: no lease, snapshot, heartbeat, segment
        held.release()
        out = call.result()
        key = _retried_once(rec)
        assert _outcomes(out) == [(sc.iids[n], 200, 1) for n in "ABC"]
        after = sc.state()
        _applied_once(sc, list("ABC"))
        assert after["stored"] == before["stored"] + 1 and after["violations"] == []
        for n in "ABC":  # each instance's snapshot stored, B's heartbeat's last
            assert after["instances"][n][3] != before["instances"][n][3], n
        assert '"waiting": 2' in after["instances"]["B"][2]
        _replayed(sc, {"items": items}, key, out)


def test_a_kill_in_the_per_item_path_applies_nothing_and_the_fenced_item_refuses_only_itself(db_url):
    with ApiServer(db_url) as server:
        sc = scene(server, db_url, "ALC", "ALC")  # instances A < L < C: the per-item path's order
        sc.lapse("L")
        items = [sc.item(n) for n in "ALC"]
        before = sc.state()
        w = sc.works["C"]
        # C's first segment, held: the folded path never writes (L is fenced: it is undone after
        # its checks), the per-item path writes A's segment, refuses L, and waits writing C's
        held = segment_slot(db_url, sc.run, w.sample_id, sc.iids["C"], w.attempt)
        rec = sc.recorded()
        call = Call(lambda: rec.client.sync(sc.run, items))
        first = blocked_by(db_url, held.pid)
        assert first.wrote and ("segments", WRITES) in locks_held(db_url, first.pid)
        assert "INSERT INTO segments" in first.query, first
        terminate(db_url, first.pid)
        blocked_by(db_url, held.pid, other_than=[first.pid])  # the retry, where the first was
        assert sc.state() == before  # A's segment went with the transaction
        held.release()
        out = call.result()
        key = _retried_once(rec)
        a, lapsed, c = (sc.iids[n] for n in "ALC")
        assert _outcomes(out) == [(a, 200, 1), (lapsed, 409, 0), (c, 200, 1)]
        assert out.results[1].error is not None and out.results[1].error.code == "conflict"
        after = sc.state()
        _applied_once(sc, list("ALC"), refused=("L",))
        assert after["instances"]["L"] == before["instances"]["L"]  # not renewed, no snapshot
        assert after["stored"] == before["stored"] + 1 and after["violations"] == []
        _replayed(sc, {"items": items}, key, out)


def test_a_kill_in_a_delivering_node_poll_loses_no_delivery(db_url):
    with ApiServer(db_url) as server:
        sc = scene(server, db_url, "AB", "AB", deliver=False)
        for n in "AB":
            sc.lease_left(n, LEASE / 2)  # a quarter spent: the poll renews (writes) before delivering
        before = sc.state()
        held = sample_lock(db_url, sc.samples["B"])
        rec = sc.recorded()
        call = Call(lambda: rec.client.sync(sc.run, poll=[sc.iids["A"], sc.iids["B"]], wait=0))
        first = blocked_by(db_url, held.pid)
        assert first.wrote and ("instances", WRITES) in locks_held(db_url, first.pid)  # leases renewed
        terminate(db_url, first.pid)
        blocked_by(db_url, held.pid, other_than=[first.pid])
        assert sc.state() == before  # not delivered, not renewed
        held.release()
        out = call.result()
        _retried_once(rec)
        assert [(d.instance_id, d.status, [w.sample_id for w in d.work]) for d in out.deliveries] == [
            (sc.iids[n], 200, [sc.samples[n]]) for n in "AB"
        ]
        after = sc.state()
        assert all(after["samples"][n][4] for n in "AB")  # delivered, once
        assert after["stored"] == before["stored"] + 1 and after["violations"] == []


# ---- killed at the commit: a private server whose commits wait for a standby on demand ----------


@pytest.fixture(scope="module")
def held_commits_url() -> Iterator[str]:
    """A private embedded server with durable commits (synchronous_commit on, WAL senders on)
    on which `commits_held` may hold every commit: it is server-wide, so never the shared one."""
    home = Path(tempfile.mkdtemp(prefix="sf-nodekill-"))
    pg = EmbeddedPostgres(home, server_options={"fsync": "off", "synchronous_commit": "on", "max_connections": "100"})
    try:
        pg.start()
        url = pg.url()
        migrate.upgrade(url)
        yield url
    finally:
        try:
            pg.stop()
        finally:
            shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def held_commits_api(held_commits_url) -> Iterator[ApiServer]:
    # no pruning of stored outcomes meanwhile: the only commit held is the node's
    with ApiServer(held_commits_url, STALEFLOW_API_IDEMPOTENCY_TTL="0") as server:
        yield server


@pytest.mark.embedded
@pytest.mark.parametrize("fenced", [False, True], ids=["folded", "per-item"])
def test_a_kill_at_the_commit_is_applied_once_and_the_retry_gets_the_same_outcomes(
    held_commits_url, held_commits_api, fenced
):
    url, server = held_commits_url, held_commits_api
    names = "ALC" if fenced else "ABC"
    sc = scene(server, url, names, names)
    if fenced:
        sc.lapse("L")
    items = [sc.item(n) for n in names]
    before = sc.state()
    rec = sc.recorded()
    with commits_held(url):
        call = Call(lambda: rec.client.sync(sc.run, items))
        committing = wait_for(lambda: in_sync_rep(url), "the node's commit waiting for the standby")
        terminate(url, committing.pid)  # committed locally; its client never hears it
    out = call.result()
    ids = [sc.iids[n] for n in names]
    expected = [(i, 409, 0) if n == "L" else (i, 200, 1) for n, i in zip(names, ids, strict=True)]
    assert _outcomes(out) == expected  # the stored outcomes: the first attempt's
    after = sc.state()
    _applied_once(sc, list(names), refused=("L",) if fenced else ())
    assert after["stored"] == before["stored"] + 1 and after["violations"] == []
    key = _retried_once(rec)
    _replayed(sc, {"items": items}, key, out)


@pytest.mark.embedded
def test_a_node_poll_killed_at_the_commit_delivers_its_work_on_the_retry(held_commits_url, held_commits_api):
    url, server = held_commits_url, held_commits_api
    sc = scene(server, url, "AB", "AB", deliver=False)
    before = sc.state()
    rec = sc.recorded()
    ids = [sc.iids["A"], sc.iids["B"]]
    with commits_held(url):
        call = Call(lambda: rec.client.sync(sc.run, poll=ids, wait=0))
        committing = wait_for(lambda: in_sync_rep(url), "the poll's commit waiting for the standby")
        terminate(url, committing.pid)
    out = call.result()
    # the delivery committed with the killed attempt; the retry gets that same work back
    assert [(d.instance_id, [w.sample_id for w in d.work]) for d in out.deliveries] == [
        (sc.iids[n], [sc.samples[n]]) for n in "AB"
    ]
    after = sc.state()
    assert all(after["samples"][n][4] for n in "AB") and after["stored"] == before["stored"] + 1
    key = _retried_once(rec)
    _replayed(sc, {"poll": ids}, key, out)
    again = sc.recorded().client.sync(sc.run, poll=ids, wait=0)  # a new poll: nothing twice
    assert [d.work for d in again.deliveries] == [[], []]
