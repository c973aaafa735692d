"""A whole sim run whose rollout side is ONE process driving three instances (`staleflow
rollout-worker --engine sim --instances 3`, real processes, real HTTP): it trains several
versions, every instance of the node serves, the node's calls are node syncs only (no
per-instance report, heartbeat or poll), a SIGTERM deregisters every instance, and the audit
is clean."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from api.auth import create_token
from staleflow_cli.launch import Cluster
from staleflow_db.audit import summary
from staleflow_db.db import make_engine
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from workers.rollout.engines.sim_engine import encode_prompt

WAIT_S = 120.0  # guards against a hang, never a timing assertion


def _until(cond, what: str, check) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        check()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _requests(metrics: str, route: str) -> float:
    pat = re.compile(r'staleflow_api_request_seconds_count\{[^}]*route="' + re.escape(route) + r'"[^}]*\} (\S+)')
    return sum(float(v) for v in pat.findall(metrics))


@pytest.mark.slow
def test_a_three_instance_node_runs_a_sim_run_and_the_audit_is_clean(db_url, tmp_path):
    engine = make_engine(db_url)
    protocol = Protocol(engine)
    try:
        run = protocol.create_run(
            "node", RunConfig(batch_size=2, group_size=2, eta=1, max_response_tokens=128, max_prompt_tokens=64)
        )
        protocol.enqueue(run, [Prompt(f"g{k}", encode_prompt(16, 24, 0.3)) for k in range(200)])
        tokens = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward")}
        version = lambda: protocol.reads.status(run)["version"]  # noqa: E731
        with Cluster(tmp_path, db_url, env={"STALEFLOW_SIM_TIME_SCALE": "0.01"}) as cluster:
            api = cluster.start_api()
            common = ["--run", str(run)]
            cluster.spawn("coordinator", ["coordinator", *common, "--lease", "2"])
            cluster.spawn(
                "reward", ["reward-worker", *common, "--verifier", "sim"], env={"STALEFLOW_TOKEN": tokens["reward"]}
            )
            node = cluster.spawn(
                "node",
                ["rollout-worker", *common, "--engine", "sim", "--instances", "3", "--heartbeat", "0.25"],
                env={"STALEFLOW_TOKEN": tokens["rollout"]},
            )
            cluster.spawn(
                "trainer",
                ["trainer", *common, "--sim", "--sim-overhead", "0.1", "--sim-s-per-token", "0", "--wait", "1"],
                env={"STALEFLOW_TOKEN": tokens["trainer"]},
            )
            _until(lambda: version() >= 4, "four versions trained", cluster.check)
            with engine.connect() as c:
                served = c.exec_driver_sql(
                    f"SELECT count(DISTINCT instance_id) FROM segments WHERE run_id = {run}"
                ).scalar_one()
                registered = c.exec_driver_sql(f"SELECT count(*) FROM instances WHERE run_id = {run}").scalar_one()
            assert registered == 3 and served >= 2  # the coordinator spreads work over the node's instances
            metrics = httpx.get(f"{api}/metrics", timeout=10).text
            base = "/v1/runs/{run_id}/instances"
            assert _requests(metrics, f"{base}/sync") > 0
            for per_instance in ("segments", "heartbeat", "poll"):
                assert _requests(metrics, f"{base}/{{instance_id}}/{per_instance}") == 0, per_instance
            cluster.stop("node")
            assert node.popen.returncode == 0, node.tail(40)
            with engine.connect() as c:
                states = c.exec_driver_sql(f"SELECT DISTINCT state FROM instances WHERE run_id = {run}").scalars().all()
            assert states == ["deregistered"], states
        assert summary(engine, run)["violations"] == []
    finally:
        engine.dispose()
