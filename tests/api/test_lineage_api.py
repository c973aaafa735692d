"""The lineage endpoint on a multi-turn trajectory: its generated turns and the observation
between them, the version of each turn with the checksum step 0 published for it, and the
reward with its metrics and the token that posted it over REST; the export page carries the
same trajectory's loss mask and per-token versions, also once its payloads are in the payload
store."""

from __future__ import annotations

from api.auth import create_token
from staleflow_db.audit import violations
from staleflow_db.payload_store import offload_run, open_store
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig
from tests.api.test_api_errors import expect
from tests.api_helpers import in_process
from workers.wire.enums import SegmentKind as K


def _members(engine, group: int) -> list[int]:
    from sqlalchemy import text

    with engine.connect() as c:
        return c.execute(text("SELECT id FROM samples WHERE group_id = :g ORDER BY idx"), {"g": group}).scalars().all()


def _ident(engine, sid: int) -> dict:
    from sqlalchemy import text

    with engine.connect() as c:
        i, tok = c.execute(text("SELECT instance_id, route_token FROM samples WHERE id = :s"), {"s": sid}).one()
    return {"instance_id": i, "route_token": tok}


def _routed(p: Protocol, run: int, sid: int, inst: int) -> int:
    (r,) = p.route(run, [(sid, inst)])
    return r.attempt


def test_lineage_of_a_trajectory_of_turns_over_rest(db_url, engine, tmp_path):
    p = Protocol(engine)
    run = p.create_run("turns", RunConfig(batch_size=1, group_size=1, samples_per_group=1, eta=1))
    first, second = p.enqueue(run, [Prompt("a", [1, 2]), Prompt("b", [3])])
    reward = create_token(engine, "reward", run, name="judge")
    observer = create_token(engine, "observer", run)["token"]
    with in_process(db_url) as http:

        def score() -> None:
            tasks = http.post(
                f"/v1/runs/{run}/rewards/claim",
                json={"limit": 10},
                headers={"Authorization": f"Bearer {reward['token']}"},
            ).json()["tasks"]
            body = {"rewards": [{"sample_id": t["sample_id"], "reward_attempt": t["reward_attempt"], "reward": 0.5,
                                 "metrics": {"acc": 1.0}} for t in tasks]}  # fmt: skip
            r = http.post(f"/v1/runs/{run}/rewards", json=body, headers={"Authorization": f"Bearer {reward['token']}"})
            assert r.status_code == 200, r.text

        # step 0: one single-turn sample at version 0; publishing it makes version 1 (checksum "sha256:v1")
        i0 = p.register_instance(run, "i0", 0)
        (s0,) = _members(engine, first)
        att = _routed(p, run, s0, i0)
        p.report(run, [Report(s0, att, 0, [7], [-0.5], K.FINISHED, **_ident(engine, s0))])
        score()
        batch = p.consume(run, 0)
        assert batch is not None
        p.publish(run, 0, batch.consume_fence, 10, "sha256:v1", "ps://1")

        # step 1: a turn at version 1, the environment's observation, the final turn
        i1 = p.register_instance(run, "i1", 1)
        (a,) = _members(engine, second)
        att = _routed(p, run, a, i1)
        p.report(run, [Report(a, att, 1, [4, 5], [-0.1, -0.2], K.PARTIAL, **_ident(engine, a))])
        ident = _ident(engine, a)
        p.report(run, [Report(a, att, None, [9], [], K.INTERRUPTED, None, False, **ident)])
        att = _routed(p, run, a, i1)
        p.report(run, [Report(a, att, 1, [6], [-0.3], K.FINISHED, **_ident(engine, a))])
        score()
        batch = p.consume(run, 1)
        assert batch is not None
        p.publish(run, 1, batch.consume_fence, 10, "sha256:v2", "ps://2")
        assert violations(engine, run) == []

        http.headers["Authorization"] = f"Bearer {observer}"
        got = http.get(f"/v1/runs/{run}/lineage", params={"step": 1})
        assert got.status_code == 200, got.text
        rows = got.json()["rows"]
        assert [(r["seq"], r["generated"], r["version"], r["checksum"], r["published_by_step"]) for r in rows] == [
            (0, True, 1, "sha256:v1", 0),
            (1, False, None, None, None),
            (2, True, 1, "sha256:v1", 0),
        ]
        assert {(r["instance_name"], r["location"] or "-") for r in rows} == {("i1", "ps://1"), ("i1", "-")}
        assert {(r["reward"], r["scorer_token_id"], r["scorer_name"], r["scorer_role"]) for r in rows} == {
            (0.5, reward["id"], "judge", "reward")
        }
        assert {r["reward_metrics"]["acc"] for r in rows} == {1.0}
        step0 = http.get(f"/v1/runs/{run}/lineage", params={"step": 0}).json()["rows"]
        assert [(r["version"], r["checksum"]) for r in step0] == [(0, None)]  # the initial model
        expect(http.get(f"/v1/runs/{run}/lineage", params={"step": 2}), 404)
        expect(http.get(f"/v1/runs/{run}/lineage", params={"step": 1, "sample": s0}), 404)

        (row,) = http.get(f"/v1/runs/{run}/export", params={"after": s0, "trained": True}).json()["rows"]
        assert (row["response_tokens"], row["loss_mask"], row["token_versions"]) == (
            [4, 5, 9, 6],
            [1, 1, 0, 1],
            [1, 1, None, 1],
        )
        assert (row["seg_lengths"], row["seg_versions"], row["step"], row["staleness"]) == (
            [2, 1, 1],
            [1, None, 1],
            1,
            0,
        )
        assert row["logprobs"][2] == 0.0 and row["reward_token_id"] == reward["id"]

        # the payloads moved to the payload store: the API's export reads through it, the same row
        offload_run(engine, open_store(tmp_path.as_uri()), run)
        (again,) = http.get(f"/v1/runs/{run}/export", params={"after": s0, "trained": True}).json()["rows"]
        assert again == row
        assert violations(engine, run) == []
