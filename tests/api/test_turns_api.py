"""Multi-turn over the REST API, as a rollout instance speaks it: an observation segment
(`generated: false`) between turns, the prefix mask and meta delivered by poll, and the
rollout side's drop of a trajectory whose environment failed (`POST .../instances/{id}/drops`:
fenced by the route, 409 for a lost route, 422 for a reason a rollout instance may not give,
a retry changes nothing), visible in the audit."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from api.auth import create_token
from staleflow_db.audit import summary, violations
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from tests.api.test_api_errors import expect, fingerprint
from tests.api_helpers import in_process


@pytest.fixture
def routed(db_url, engine):
    """A run (N=2, N'=3) whose three samples are routed to one instance registered over REST."""
    p = Protocol(engine)
    run = p.create_run("t", RunConfig(batch_size=1, group_size=2, samples_per_group=3, eta=0))
    (group,) = p.enqueue(run, [Prompt("k", [1, 2], {"target": 7})])
    rollout = create_token(engine, "rollout", run)["token"]
    with in_process(db_url) as http:
        http.headers["Authorization"] = f"Bearer {rollout}"
        inst = http.post(f"/v1/runs/{run}/instances", json={"name": "cpu", "version": 0}).json()["instance_id"]
        with engine.connect() as c:
            ids = (
                c.execute(text("SELECT id FROM samples WHERE group_id = :g ORDER BY id"), {"g": group}).scalars().all()
            )
        p.route(run, [(s, inst) for s in ids])
        work = http.post(f"/v1/runs/{run}/instances/{inst}/poll", params={"wait": 0}).json()["work"]
        assert [w["meta"] for w in work] == [{"target": 7}] * 3 and all(w["prefix_mask"] == [] for w in work)
        yield {"http": http, "run": run, "inst": inst, "work": work, "engine": engine, "p": p}


def _segment(w, **over):
    return {"sample_id": w["sample_id"], "attempt": w["attempt"], "route_token": w["route_token"], **over}


def test_an_observation_between_turns_comes_back_with_its_mask(routed):
    http, run, inst, (a, _, _) = routed["http"], routed["run"], routed["inst"], routed["work"]
    url = f"/v1/runs/{run}/instances/{inst}/segments"
    turn = _segment(a, version=0, tokens=[5, 0], logprobs=[-0.1, -0.2], kind="partial")
    assert http.post(url, json={"reports": [turn]}).status_code == 200
    bad = _segment(a, version=0, tokens=[3], kind="interrupted", generated=False)  # a version claim
    before = fingerprint(routed["engine"])
    expect(http.post(url, json={"reports": [bad]}), 422)
    assert fingerprint(routed["engine"]) == before
    obs = _segment(a, tokens=[3], kind="interrupted", generated=False)
    assert http.post(url, json={"reports": [obs]}).status_code == 200
    routed["p"].route(run, [(a["sample_id"], inst)])  # its next turn
    (w,) = http.post(f"/v1/runs/{run}/instances/{inst}/poll", params={"wait": 0}).json()["work"]
    assert (w["prefix_tokens"], w["prefix_mask"], w["prefix_logprobs"]) == (
        [5, 0, 3],
        [1, 1, 0],
        pytest.approx([-0.1, -0.2, 0.0]),
    )
    assert violations(routed["engine"], run) == []


def test_a_failed_environment_drops_its_trajectory_with_the_reason(routed):
    http, run, inst, (a, b, c), engine = (routed[k] for k in ("http", "run", "inst", "work", "engine"))
    url = f"/v1/runs/{run}/instances/{inst}/drops"
    before = fingerprint(engine)
    expect(http.post(url, json={"drops": [_segment(a)], "reason": "reward_failed"}), 422)  # not the instance's
    expect(http.post(url, json={"drops": [_segment(a)], "reason": "surplus"}), 422)
    expect(http.post(url, json={"drops": [{**_segment(a), "attempt": a["attempt"] + 1}]}), 409)  # a lost route
    expect(http.post(url, json={"drops": [_segment(a), _segment(a)]}), 422)
    assert fingerprint(engine) == before
    one = {"drops": [_segment(a)], "reason": "env_timeout"}
    r = http.post(url, json=one)
    assert r.status_code == 200 and r.json() == {"dropped": [a["sample_id"]]}, r.text
    assert http.post(url, json=one).json() == {"dropped": []}  # a retry: nothing more to do
    r = http.post(url, json={"drops": [_segment(b)]})  # env_failed by default: the group is short of N
    assert r.status_code == 200 and r.json() == {"dropped": [b["sample_id"]]}
    drops = {d["reason"]: d["samples"] for d in summary(engine, run)["drops"]}
    assert drops == {"env_timeout": 1, "env_failed": 1, "insufficient_members": 1}
    assert violations(engine, run) == []
    expect(http.post(url, json={"drops": [_segment(c)]}), 409)  # aborted with its group: its route is gone
