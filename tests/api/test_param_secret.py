"""The run's parameter-server keys over the API (GET /v1/runs/{run}/param-secret): which token
gets which key, one secret per run kept across calls and replicas, and the keys opening that
run's parameter server and no other."""

from __future__ import annotations

import pytest

from api.auth import create_token
from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig
from tests.api_helpers import in_process
from workers.trainer.param_auth import PSAuthError, PSCredentials, PSKeys
from workers.trainer.param_client import ParamClient
from workers.trainer.param_server import ParamServer


def _keys(http, run: int, token: str) -> tuple[int, dict[str, str]]:
    r = http.get(f"/v1/runs/{run}/param-secret", headers={"Authorization": f"Bearer {token}"})
    return r.status_code, (r.json()["keys"] if r.status_code == 200 else r.json())


def test_each_role_gets_its_keys_and_each_run_its_own(db_url, engine):
    p = Protocol(engine)
    run_a = p.create_run("a", RunConfig(batch_size=1, group_size=1, eta=0))
    run_b = p.create_run("b", RunConfig(batch_size=1, group_size=1, eta=0))
    tok = {r: create_token(engine, r, run_a)["token"] for r in ("admin", "trainer", "rollout", "reward", "observer")}
    with in_process(db_url) as http:
        status, rollout = _keys(http, run_a, tok["rollout"])
        assert status == 200 and set(rollout) == {"rollout"}
        status, trainer = _keys(http, run_a, tok["trainer"])
        assert status == 200 and set(trainer) == {"trainer", "rollout"} and trainer["rollout"] == rollout["rollout"]
        assert trainer["trainer"] != trainer["rollout"]
        assert _keys(http, run_a, tok["admin"]) == (200, trainer)
        assert _keys(http, run_a, tok["trainer"]) == (200, trainer)  # one secret per run, kept
        for role in ("reward", "observer"):
            status, body = _keys(http, run_a, tok[role])
            assert status == 403 and "may not do this" in body["error"]["message"]
        status, body = _keys(http, run_b, tok["trainer"])  # a token of run A asks for run B's
        assert status == 403 and f"limited to run {run_a}" in body["error"]["message"]
        everywhere = create_token(engine, "trainer")["token"]  # a token valid for every run
        status, other = _keys(http, run_b, everywhere)
        assert status == 200 and set(other.values()).isdisjoint(trainer.values())
        status, body = _keys(http, 999_999, everywhere)
        assert status == 404 and body["error"]["code"] == "not_found"
    with in_process(db_url) as http:  # another replica derives the same keys
        assert _keys(http, run_a, tok["trainer"]) == (200, trainer)


def test_the_keys_open_their_runs_parameter_server_only(db_url, engine, tmp_path):
    p = Protocol(engine)
    run_a = p.create_run("a", RunConfig(batch_size=1, group_size=1, eta=0))
    run_b = p.create_run("b", RunConfig(batch_size=1, group_size=1, eta=0))
    with in_process(db_url) as http:
        trainer = _keys(http, run_a, create_token(engine, "trainer", run_a)["token"])[1]
        rollout = _keys(http, run_a, create_token(engine, "rollout", run_a)["token"])[1]
        theirs = _keys(http, run_b, create_token(engine, "trainer", run_b)["token"])[1]
    keys = PSKeys(run_a, {r: bytes.fromhex(k) for r, k in trainer.items()})
    ps = ParamServer(tmp_path, auth=keys)
    addr = ps.start()
    try:
        import torch

        sd = {"w": torch.arange(6.0).reshape(2, 3)}
        pusher = ParamClient(addr, credentials=PSCredentials(run_a, "trainer", bytes.fromhex(trainer["trainer"])))
        pusher.commit(0, pusher.push(sd, 0))
        puller = ParamClient(addr, credentials=PSCredentials(run_a, "rollout", bytes.fromhex(rollout["rollout"])))
        assert torch.equal(puller.pull()[0]["w"], sd["w"])
        # run B's trainer key presented as run A's: refused by the PS, nothing pushed
        stranger = ParamClient(addr, credentials=PSCredentials(run_a, "trainer", bytes.fromhex(theirs["trainer"])))
        with pytest.raises(PSAuthError, match=f"wrong trainer key for run {run_a}"):
            stranger.push({"w": torch.zeros(2, 3)}, 1)
        assert pusher.latest()["version"] == 0
    finally:
        ps.stop()
