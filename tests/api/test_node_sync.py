"""Node sync over real HTTP to a real API process: a node of three instances sends their
reports and heartbeats in one call; when one instance's lease has lapsed, its item is refused
(409, nothing of it applied, its lease not renewed) while the others apply, and its delivery is
refused the same way; a replay of the same request id returns the stored outcome, another body
under it is refused; bad input refuses the whole call, naming the item and field."""

from __future__ import annotations

import threading
import time

import pytest
from api_helpers import ApiServer, token
from sqlalchemy import text

from staleflow_db.db import make_engine

LEASE = 30.0


def _partial(work, n: int = 2, kind: str = "partial") -> dict:
    return {
        "sample_id": work.sample_id,
        "attempt": work.attempt,
        "route_token": work.route_token,
        "version": 0,
        "tokens": [5] * n,
        "logprobs": [-0.5] * n,
        "kind": kind,
    }


def _set_lease_left(engine, iid: int, seconds: float) -> None:
    with engine.begin() as c:
        c.execute(
            text("UPDATE instances SET lease_expires_at = now() + make_interval(secs => :s) WHERE id = :i"),
            {"i": iid, "s": seconds},
        )


def _tokens(engine, sid: int) -> int:
    with engine.connect() as c:
        return c.execute(text("SELECT n_tokens FROM samples WHERE id = :i"), {"i": sid}).scalar_one()


@pytest.fixture
def node(db_url):
    """Three instances of one token, each holding one routed, delivered sample (one sync poll)."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("node", batch_size=3, group_size=1, eta=0, max_response_tokens=100).id
        admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(3)])
        rollout = server.client(token(db_url, "rollout", run))
        iids = [rollout.register(run, f"i{k}", 0, lease_seconds=LEASE).instance_id for k in range(3)]
        queued = [q.sample_id for q in admin.snapshot(run).queued]
        admin.route(run, list(zip(queued, iids, strict=True)))
        out = rollout.sync(run, poll=iids, wait=0)
        assert [d.instance_id for d in out.deliveries] == iids and not out.results
        works = {d.instance_id: d.work[0] for d in out.deliveries}
        engine = make_engine(db_url)
        try:
            yield server, admin, rollout, run, iids, works, engine
        finally:
            engine.dispose()


def test_a_lapsed_instance_is_refused_alone_and_the_others_apply(node):
    server, admin, rollout, run, iids, works, engine = node
    a, b, c = iids
    _set_lease_left(engine, b, -1.0)  # b's lease lapsed mid-run
    items = [{"instance_id": i, "reports": [_partial(works[i])], "snapshot": {"running": 1}} for i in iids]
    items[2]["heartbeat"] = {"version": 0, "lease_seconds": LEASE}  # a report and a heartbeat in one item
    out = rollout.sync(run, items, poll=iids, wait=0)
    assert [(r.instance_id, r.status, r.applied) for r in out.results] == [(a, 200, 1), (b, 409, 0), (c, 200, 1)]
    assert out.results[1].error is not None and out.results[1].error.code == "conflict"
    assert [(d.instance_id, d.status) for d in out.deliveries] == [(a, 200), (b, 409), (c, 200)]
    # b's tokens were not applied, nor its lease renewed; a's and c's were
    assert [_tokens(engine, works[i].sample_id) for i in iids] == [2, 0, 2]
    with engine.connect() as conn:
        lapsed = conn.execute(text("SELECT lease_expires_at < now() FROM instances WHERE id = :i"), {"i": b})
        assert lapsed.scalar_one()
    # the sweep requeues only b's sample; a and c go on and finish
    assert admin.expire_instances(run) == [b]
    assert [q.sample_id for q in admin.snapshot(run).queued] == [works[b].sample_id]
    done = rollout.sync(run, [{"instance_id": i, "reports": [_partial(works[i], 1, "finished")]} for i in (a, c)])
    assert [(r.status, r.applied) for r in done.results] == [(200, 1), (200, 1)]


def test_a_lost_route_refuses_only_its_item(node):
    server, admin, rollout, run, iids, works, engine = node
    a, b, c = iids
    wrong = dict(_partial(works[a]), route_token="00000000-0000-4000-8000-000000000000")
    out = rollout.sync(
        run, [{"instance_id": a, "reports": [wrong]}, {"instance_id": c, "reports": [_partial(works[c])]}]
    )
    assert [(r.status, r.applied) for r in out.results] == [(409, 0), (200, 1)]
    assert out.results[0].error is not None and out.results[0].error.items[0]["id"] == works[a].sample_id
    assert [_tokens(engine, works[i].sample_id) for i in iids] == [0, 0, 2]


def test_a_replay_returns_the_stored_outcome_and_another_body_is_refused(node):
    server, admin, rollout, run, iids, works, engine = node
    url = f"/v1/runs/{run}/instances/sync"
    body = {"items": [{"instance_id": i, "reports": [_partial(works[i])]} for i in iids]}
    headers = {"Idempotency-Key": "node-flush-1"}
    first = rollout.http.post(url, json=body, headers=headers)
    assert first.status_code == 200, first.text
    again = rollout.http.post(url, json=body, headers=headers)
    assert again.status_code == 200 and again.json() == first.json()
    assert [_tokens(engine, works[i].sample_id) for i in iids] == [2, 2, 2]  # applied once
    other = {"items": [{"instance_id": i, "reports": [_partial(works[i], 3)]} for i in iids]}
    refused = rollout.http.post(url, json=other, headers=headers)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "idempotency_key_reused"
    assert [_tokens(engine, works[i].sample_id) for i in iids] == [2, 2, 2]


@pytest.mark.parametrize(
    "bad, status, names",
    [
        (lambda w, i: {"instance_id": i[1], "reports": [dict(_partial(w[i[1]]), tokens="x")]}, 422, "items.1"),
        (lambda w, i: {"instance_id": i[1], "reports": [dict(_partial(w[i[1]]), version=7)]}, 422, "items.1"),
        (lambda w, i: {"instance_id": i[1]}, 422, "items.1"),
        (lambda w, i: {"instance_id": 999_999, "reports": [_partial(w[i[1]])]}, 404, "items.1.instance_id"),
        (lambda w, i: {"instance_id": i[0], "reports": [_partial(w[i[0]])]}, 422, "items.1.instance_id"),
    ],
)
def test_bad_input_names_the_item_and_applies_nothing(node, bad, status, names):
    server, admin, rollout, run, iids, works, engine = node
    body = {"items": [{"instance_id": iids[0], "reports": [_partial(works[iids[0]])]}, bad(works, iids)]}
    r = rollout.http.post(f"/v1/runs/{run}/instances/sync", json=body)
    assert r.status_code == status, r.text
    assert names in r.json()["error"]["message"], r.text
    assert [_tokens(engine, works[i].sample_id) for i in iids] == [0, 0, 0]


def test_another_tokens_instance_is_forbidden(node, db_url):
    server, admin, rollout, run, iids, works, engine = node
    other = server.client(token(db_url, "rollout", run))
    with pytest.raises(Exception) as e:
        other.sync(run, poll=iids, wait=0)
    assert getattr(e.value, "status", None) == 403 and "poll.0" in str(e.value)


def test_the_long_poll_wakes_for_any_of_its_instances(node):
    server, admin, rollout, run, iids, works, engine = node
    got: list = []
    t = threading.Thread(target=lambda: got.append(rollout.sync(run, poll=iids, wait=30)))
    t.start()
    time.sleep(0.5)  # the poll is waiting (either order delivers the command; the wait ends early)
    assert admin.interrupt(run, [works[iids[2]].sample_id]) == 1
    t.join(30)
    (out,) = got
    assert [(d.instance_id, [(c.kind, c.sample_id) for c in d.commands]) for d in out.deliveries] == [
        (iids[0], []),
        (iids[1], []),
        (iids[2], [("interrupt", works[iids[2]].sample_id)]),
    ]
