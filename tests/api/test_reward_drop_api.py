"""The reward worker's side of the REST API for rewards it brings: `POST .../rewards/drop`
(fenced by the claim: 409 for a lost claim, 422 for bad input, a retry changes nothing, other
roles refused) and rewards posted with metrics (`POST .../rewards`, 422 for bad metrics)."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig
from tests.api.test_api_errors import expect, fingerprint
from tests.api_helpers import in_process
from workers.wire.enums import SegmentKind


@pytest.fixture
def claimed(db_url, engine):
    """A run (N=2, N'=3) whose three samples are finished and claimed by a reward worker."""
    p = Protocol(engine)
    run = p.create_run("r", RunConfig(batch_size=1, group_size=2, samples_per_group=3, eta=0))
    (group,) = p.enqueue(run, [Prompt("k", [1, 2])])
    inst = p.register_instance(run, "gpu0", 0)
    with engine.connect() as c:
        ids = c.execute(text("SELECT id FROM samples WHERE group_id = :g ORDER BY id"), {"g": group}).scalars().all()
    routes = p.route(run, [(s, inst) for s in ids])
    p.report(
        run,
        [
            Report(
                r.sample_id,
                r.attempt,
                0,
                [5],
                [-0.1],
                SegmentKind.FINISHED,
                instance_id=inst,
                route_token=r.route_token,
            )
            for r in routes
        ],
    )
    reward = create_token(engine, "reward", run)["token"]
    rollout = create_token(engine, "rollout", run)["token"]
    with in_process(db_url) as http:
        http.headers["Authorization"] = f"Bearer {reward}"
        tasks = http.post(f"/v1/runs/{run}/rewards/claim", json={"limit": 10}).json()["tasks"]
        assert len(tasks) == 3
        yield {"http": http, "run": run, "tasks": tasks, "engine": engine, "rollout": rollout, "group": group}


def _state(engine, sid: int) -> tuple:
    with engine.connect() as c:
        return tuple(
            c.execute(text("SELECT state::text, reason, reward_metrics FROM samples WHERE id = :s"), {"s": sid}).one()
        )


def test_drop_is_fenced_by_the_claim_and_idempotent(claimed):
    http, run, (a, b, c), engine = claimed["http"], claimed["run"], claimed["tasks"], claimed["engine"]
    url = f"/v1/runs/{run}/rewards/drop"
    one = {"drops": [{"sample_id": a["sample_id"], "reward_attempt": a["reward_attempt"]}]}
    r = http.post(url, json=one)
    assert r.status_code == 200, r.text
    assert r.json() == {"dropped": [a["sample_id"]]}
    assert _state(engine, a["sample_id"]) == ("aborted", "reward_failed", None)
    again = http.post(url, json=one)  # a retry (no request id): nothing more to do
    assert again.status_code == 200 and again.json() == {"dropped": []}
    # the other two still make N = 2: they are rewarded (b with metrics) and the group lands
    rewards = [
        {"sample_id": b["sample_id"], "reward_attempt": b["reward_attempt"], "reward": 1.0, "metrics": {"len": 1}},
        {"sample_id": c["sample_id"], "reward_attempt": c["reward_attempt"], "reward": 0.0},
    ]
    r = http.post(f"/v1/runs/{run}/rewards", json={"rewards": rewards})
    assert r.status_code == 200, r.text
    assert [g["state"] for g in r.json()["groups"]] == ["occupied"]
    assert _state(engine, b["sample_id"]) == ("rewarded", None, {"len": 1.0})
    # a drop of a sample already rewarded: its claim is spent
    late = {"drops": [{"sample_id": b["sample_id"], "reward_attempt": b["reward_attempt"]}]}
    err = expect(http.post(url, json=late), 409, "conflict")
    assert [i["id"] for i in err["items"]] == [b["sample_id"]]


def test_bad_drops_and_metrics_are_refused_and_change_nothing(claimed):
    http, run, (a, b, _), engine = claimed["http"], claimed["run"], claimed["tasks"], claimed["engine"]
    url = f"/v1/runs/{run}/rewards/drop"
    before = fingerprint(engine)
    sid, att = a["sample_id"], a["reward_attempt"]
    for body in [
        {"drops": []},
        {"drops": [{"sample_id": sid}]},
        {"drops": [{"sample_id": sid, "reward_attempt": "1"}]},
        {"drops": [{"sample_id": 0, "reward_attempt": att}]},
        {"drops": [{"sample_id": sid, "reward_attempt": att}], "reason": "bogus"},
        # the protocol's own findings are not a reward worker's to claim
        {"drops": [{"sample_id": sid, "reward_attempt": att}], "reason": "window_closed"},
        {"drops": [{"sample_id": sid, "reward_attempt": att, "extra": 1}]},
    ]:
        expect(http.post(url, json=body), 422)
    expect(http.post(url, json={"drops": [{"sample_id": sid, "reward_attempt": att}] * 2}), 422)
    expect(http.post(url, json={"drops": [{"sample_id": sid, "reward_attempt": att + 1}]}), 409, "conflict")
    expect(http.post(url, json={"drops": [{"sample_id": 10**12, "reward_attempt": 1}]}), 404)
    rollout = {"Authorization": f"Bearer {claimed['rollout']}"}
    expect(http.post(url, json={"drops": [{"sample_id": sid, "reward_attempt": att}]}, headers=rollout), 403)
    for metrics in [{"x": "1"}, {"x": None}, {"": 1.0}, {str(i): 1.0 for i in range(65)}, [1.0]]:
        rewards = [
            {"sample_id": b["sample_id"], "reward_attempt": b["reward_attempt"], "reward": 1.0, "metrics": metrics}
        ]
        expect(http.post(f"/v1/runs/{run}/rewards", json={"rewards": rewards}), 422)
    assert fingerprint(engine) == before
