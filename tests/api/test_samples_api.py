"""The sample browser's JSON over HTTP on a real database: each filter of
`GET /v1/runs/{run}/samples` (status, step, reward, staleness, length) and its keyset pages;
one sample's text, turns, versions, timeline and scorer; and the 4xx: a bad filter is a 422
naming the parameter, an unknown run or sample a 404, a missing token 401, another run's 403."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig
from tests.api.test_api_errors import expect
from tests.api_helpers import in_process
from tests.sample_browser_helpers import B_OBSERVATION, B_TURN1, B_TURN2, attempt, browsable_run, ident
from workers.wire.enums import SegmentKind as K


@pytest.fixture
def world(db_url, engine):
    ids = browsable_run(engine)
    observer = create_token(engine, "observer", ids["run"])["token"]
    with in_process(db_url) as http:
        http.headers["Authorization"] = f"Bearer {observer}"
        yield {**ids, "http": http, "engine": engine, "db_url": db_url}


def _ids(world, **params) -> list[int]:
    r = world["http"].get(f"/v1/runs/{world['run']}/samples", params=params)
    assert r.status_code == 200, r.text
    return [row["sample_id"] for row in r.json()["rows"]]


def test_each_filter_selects_its_samples(world):
    a, b, c, d = (world[k] for k in "abcd")
    assert _ids(world) == [d, c, b, a]  # newest first
    assert _ids(world, status="trained") == [b, a]
    assert _ids(world, status="dropped") == [c]
    assert _ids(world, status="in_flight") == [d]
    assert _ids(world, status=["dropped", "in_flight"]) == [d, c]
    assert _ids(world, status="rewarded") == []
    assert _ids(world, step=1) == [b]
    assert _ids(world, step=0) == [a]
    assert _ids(world, staleness_min=1) == [b]
    assert _ids(world, staleness_max=0) == [a]
    assert _ids(world, reward_min=0.9) == [a]
    assert _ids(world, reward_min=0.2, reward_max=0.6) == [b]
    n_b = sum(len(s.encode()) for s in (*B_TURN1, B_OBSERVATION, B_TURN2))
    assert _ids(world, length_min=n_b) == [b]
    assert _ids(world, length_max=1) == [c, a]  # "x" and "4"
    assert _ids(world, status="trained", length_max=1) == [a]
    (row,) = world["http"].get(f"/v1/runs/{world['run']}/samples", params={"step": 1}).json()["rows"]
    assert (row["status"], row["v_traj"], row["staleness"], row["reward"], row["n_segments"]) == (
        "trained",
        0,
        1,
        0.5,
        5,
    )
    (dropped,) = world["http"].get(f"/v1/runs/{world['run']}/samples", params={"status": "dropped"}).json()["rows"]
    assert (dropped["state"], dropped["reason"]) == ("aborted", "env_failed")


def test_keyset_pages_cover_every_sample_once(world):
    http, run = world["http"], world["run"]
    seen, before = [], None
    while True:
        params = {"limit": 3, **({"before": before} if before else {})}
        page = http.get(f"/v1/runs/{run}/samples", params=params).json()
        seen += [r["sample_id"] for r in page["rows"]]
        before = page["next_before"]
        if before is None:
            break
    assert seen == [world[k] for k in "dcba"]
    last = http.get(f"/v1/runs/{run}/samples", params={"limit": 2, "before": world["c"]}).json()
    assert [r["sample_id"] for r in last["rows"]] == [world["b"], world["a"]] and last["next_before"] is None


def test_one_sample_has_its_turns_versions_timeline_and_scorer(world):
    got = world["http"].get(f"/v1/runs/{world['run']}/samples/{world['b']}")
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["decoding"] == "utf-8 bytes" and body["prompt"]["text"] == "Qb: 2+2?"
    segs = body["segments"]
    assert [(s["text"], s["generated"], s["version"], s["turn"]) for s in segs] == [
        (B_TURN1[0], True, 0, 1),
        (B_TURN1[1], True, 0, 1),
        (B_TURN1[2], True, 1, 1),
        (B_OBSERVATION, False, None, None),
        (B_TURN2, True, 1, 2),
    ]
    assert [s["migrated_from"] for s in segs] == [None, None, "gpu-0", None, None]
    assert body["turns"] == 2 and body["versions"] == [0, 1]
    kinds = [e["kind"] for e in body["timeline"]]
    assert {"command_interrupt", "sample_interrupted", "migration", "observation", "sample_rewarded"} <= set(kinds)
    assert kinds.index("sample_interrupted") < kinds.index("migration") < kinds.index("observation")
    assert kinds[-1] == "published" and body["timeline"][-1]["text"] == "trained at step 1: version 2 published"
    assert kinds.count("published") == 1
    (migration,) = [e for e in body["timeline"] if e["kind"] == "migration"]
    assert migration["text"] == "migrated from gpu-0 to gpu-1"
    s = body["sample"]
    assert (s["status"], s["step"], s["staleness"], s["reward"], s["reward_metrics"]) == (
        "trained",
        1,
        1,
        0.5,
        {"accuracy": 0.0},
    )
    assert (s["scorer_token_id"], s["scorer_name"], s["scorer_role"]) == (world["scorer"], "judge", "reward")
    assert body["run"]["eta"] == 2


def test_token_ids_when_the_tokens_are_not_text(world, engine):
    p, run = Protocol(engine), world["run"]
    (g,) = p.enqueue(run, [Prompt("ids", [1, 300, 2])])
    with engine.connect() as c:
        sid = c.execute(text("SELECT id FROM samples WHERE group_id = :g"), {"g": g}).scalar_one()
    p.route(run, [(sid, world["i1"])])
    p.report(run, [Report(sid, attempt(engine, sid), 2, [0, 5], [-1.0, -1.0], K.PARTIAL, **ident(engine, sid))])
    body = world["http"].get(f"/v1/runs/{run}/samples/{sid}").json()
    assert body["decoding"] == "token ids" and body["prompt"]["text"] is None
    assert body["segments"][0]["text"] is None and body["segments"][0]["token_ids"] == [0, 5]


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"status": "finished_ish"}, "status"),
        ({"step": -1}, "step"),
        ({"step": "two"}, "step"),
        ({"reward_min": "nan"}, "reward_min"),
        ({"reward_min": 1, "reward_max": 0}, "reward_min"),
        ({"staleness_min": 3, "staleness_max": 1}, "staleness_min"),
        ({"staleness_max": -1}, "staleness_max"),
        ({"length_min": 10, "length_max": 2}, "length_min"),
        ({"length_max": 2**31}, "length_max"),
        ({"before": 0}, "before"),
        ({"limit": 0}, "limit"),
        ({"limit": 501}, "limit"),
    ],
)
def test_a_bad_filter_is_a_422_naming_it(world, params, names):
    err = expect(world["http"].get(f"/v1/runs/{world['run']}/samples", params=params), 422, "invalid_input")
    assert f"query.{names}" in err["message"], err


def test_unknown_run_or_sample_404_and_tokens_401_403(world, engine):
    http, run = world["http"], world["run"]
    admin = {"Authorization": f"Bearer {create_token(engine, 'admin')['token']}"}
    other = Protocol(engine).create_run("other", RunConfig(batch_size=1, group_size=1, eta=0))
    expect(http.get("/v1/runs/999999/samples", headers=admin), 404)
    expect(http.get("/v1/runs/999999/samples/1", headers=admin), 404)
    expect(http.get(f"/v1/runs/{run}/samples/999999"), 404)
    expect(http.get(f"/v1/runs/{other}/samples/{world['a']}", headers=admin), 404)  # a sample of another run
    assert http.get(f"/v1/runs/{other}/samples", headers=admin).json()["rows"] == []
    expect(http.get(f"/v1/runs/{run}/samples/0"), 422)
    expect(http.get(f"/v1/runs/{other}/samples"), 403)  # the observer's token is for `run`
    expect(http.get(f"/v1/runs/{other}/samples/{world['a']}"), 403)
    expect(http.get(f"/v1/runs/{run}/samples", headers={"Authorization": "Bearer sf_bogus"}), 401)
    for path in (f"/v1/runs/{run}/samples", f"/v1/runs/{run}/samples/{world['a']}"):
        assert http.get(path, headers={"Authorization": ""}).status_code == 401
