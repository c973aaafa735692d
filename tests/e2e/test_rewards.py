"""Rewards you bring, end to end: real processes (API, coordinator, sim rollout worker, sim
trainer, `staleflow reward-worker`), real HTTP, a real database.

- `--reward module:function`: a function the test writes into tmp_path (on PYTHONPATH) trains
  a run; its metrics are stored with each reward and shown per step on the dashboard.
- `--reward-url`: a reward service started by the test (http.server in a subprocess) trains a
  run; the requests follow the documented contract.
- a reward that raises, and a service that hangs (timed out), are retried and then dropped as
  `reward_failed`: in the audit (`staleflow audit`), never a silent 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from api.auth import create_token
from staleflow_cli.launch import Cluster, free_port
from staleflow_db.audit import summary
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from tests.api_helpers import REPO
from workers.rollout.engines.sim_engine import encode_prompt

WAIT_S = 120.0  # guards against a hang, never a timing assertion
STEPS = 2


def _until(cond, what: str, check=lambda: None, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        check()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _sim_run(engine, name: str, prompts: int = 40) -> tuple[int, dict[str, str]]:
    protocol = Protocol(engine)
    run = protocol.create_run(
        name, RunConfig(batch_size=2, group_size=2, eta=1, max_response_tokens=32, max_prompt_tokens=32)
    )
    protocol.enqueue(run, [Prompt(f"g{k}", encode_prompt(8, 16, 0.3), {"answer": str(k % 3)}) for k in range(prompts)])
    tokens = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward", "coordinator")}
    return run, tokens


def _pythonpath(*dirs: Path) -> str:
    return os.pathsep.join([*map(str, dirs), os.environ.get("PYTHONPATH", ""), str(REPO)])


def _cluster_run(tmp_path: Path, db_url: str, run: int, tokens: dict[str, str], reward: list[str], steps: int | None):
    """Start the API, the reward worker with `reward` options, a sim rollout worker, the
    coordinator and (with `steps`) the sim trainer; returns the Cluster (a context manager)."""
    cluster = Cluster(tmp_path, db_url, env={"STALEFLOW_SIM_TIME_SCALE": "0.01", "PYTHONPATH": _pythonpath(tmp_path)})
    cluster.start_api()
    common = ["--run", str(run)]
    cluster.spawn("reward", ["reward-worker", *common, *reward], env={"STALEFLOW_TOKEN": tokens["reward"]})
    cluster.spawn(
        "rollout",
        ["rollout-worker", *common, "--engine", "sim", "--heartbeat", "0.25"],
        env={"STALEFLOW_TOKEN": tokens["rollout"]},
    )
    cluster.spawn(
        "coordinator", ["coordinator", *common, "--lease", "2"], env={"STALEFLOW_TOKEN": tokens["coordinator"]}
    )
    if steps:
        cluster.spawn(
            "trainer",
            ["trainer", *common, "--sim", "--sim-overhead", "0", "--sim-s-per-token", "0", "--wait", "1"]
            + ["--steps", str(steps)],
            env={"STALEFLOW_TOKEN": tokens["trainer"]},
            essential=False,  # exits once it trained `steps` steps
        )
    return cluster


def _version(engine, run: int) -> int:
    return Protocol(engine).reads.status(run)["version"]


def _trained(engine, run: int) -> list[tuple[int, int, float, dict | None]]:
    """(sample, response tokens, reward, reward_metrics) of every trained sample."""
    with engine.connect() as c:
        return [
            tuple(r)
            for r in c.execute(
                text(
                    "SELECT s.id, s.n_tokens, s.reward, s.reward_metrics FROM samples s"
                    " JOIN prompt_groups g ON g.id = s.group_id"
                    " WHERE s.run_id = :r AND g.state = 'consumed' AND s.state = 'rewarded' ORDER BY s.id"
                ),
                {"r": run},
            ).all()
        ]


def _dropped(engine, run: int) -> dict[str, int]:
    with engine.connect() as c:
        return dict(
            c.execute(
                text("SELECT reason, count(*) FROM dropped_samples WHERE run_id = :r GROUP BY 1"), {"r": run}
            ).all()
        )


USER_REWARDS = textwrap.dedent(
    """
    import asyncio
    from pathlib import Path

    def by_length(sample):
        # a reward from the response, with metrics: stored with it, shown per step
        n = len(sample.response_tokens)
        return {"reward": (n % 5) / 4, "metrics": {"length": n, "answer": float(sample.meta["answer"])}}

    async def batch_by_length(samples):
        await asyncio.sleep(0)
        return [(len(s.response_tokens) % 3) / 2 for s in samples]

    def broken(sample):
        with open(Path(__file__).with_name("calls.txt"), "a") as f:
            f.write(f"{sample.sample_id}\\n")
        raise RuntimeError("my reward has a bug")
    """
)


@pytest.fixture
def user_module(tmp_path: Path) -> str:
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    return "my_rewards"


@pytest.mark.slow
def test_a_reward_function_trains_a_run(engine, db_url, tmp_path, user_module):
    run, tokens = _sim_run(engine, "byo-fn")
    with _cluster_run(tmp_path, db_url, run, tokens, ["--reward", f"{user_module}:by_length"], STEPS) as cluster:
        _until(lambda: _version(engine, run) >= STEPS, f"{STEPS} trained steps", cluster.check)
        dashboard = httpx.get(
            f"{cluster.api_url}/v1/runs/{run}/dashboard", headers={"Authorization": f"Bearer {tokens['trainer']}"}
        )
    trained = _trained(engine, run)
    assert len(trained) >= STEPS * 2 * 2
    for _, n, reward, metrics in trained:  # the function's reward and its metrics, as it returned them
        assert reward == (n % 5) / 4
        assert metrics is not None and metrics["length"] == n and metrics["answer"] in (0.0, 1.0, 2.0)
    assert dashboard.status_code == 200, dashboard.text
    shown = {(r["step"], r["metric"]): r["mean"] for r in dashboard.json()["steps"]["reward_metrics"]}
    assert {m for _, m in shown} == {"length", "answer"}
    with engine.connect() as c:
        means = dict(
            c.execute(
                text(
                    "SELECT g.buffer, avg(s.n_tokens) FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
                    " WHERE s.run_id = :r AND g.state = 'consumed' AND s.state = 'rewarded' GROUP BY 1"
                ),
                {"r": run},
            ).all()
        )
    for step, mean in means.items():
        assert shown[(step, "length")] == pytest.approx(float(mean))
    assert summary(engine, run)["violations"] == []


@pytest.mark.slow
def test_an_async_batch_reward_function_trains_a_run(engine, db_url, tmp_path, user_module):
    run, tokens = _sim_run(engine, "byo-batch")
    reward = ["--reward", f"{user_module}:batch_by_length", "--reward-batch", "--reward-concurrency", "2"]
    with _cluster_run(tmp_path, db_url, run, tokens, reward, STEPS) as cluster:
        _until(lambda: _version(engine, run) >= STEPS, f"{STEPS} trained steps", cluster.check)
    trained = _trained(engine, run)
    assert trained and all(reward == (n % 3) / 2 and metrics is None for _, n, reward, metrics in trained)
    assert summary(engine, run)["violations"] == []


@pytest.mark.slow
def test_a_registered_verifier_still_trains_a_run(engine, db_url, tmp_path):
    run, tokens = _sim_run(engine, "verifier")
    # a long linger: the claim after each partial one waits a second, and the run still trains
    with _cluster_run(tmp_path, db_url, run, tokens, ["--verifier", "sim", "--linger", "1"], STEPS) as cluster:
        _until(lambda: _version(engine, run) >= STEPS, f"{STEPS} trained steps", cluster.check)
    trained = _trained(engine, run)
    assert trained and all(reward == (n % 7) / 6 and metrics is None for _, n, reward, metrics in trained)
    assert summary(engine, run)["violations"] == []


SERVICE = textwrap.dedent(
    """
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    MODE, LOG, READY = sys.argv[1], sys.argv[2], sys.argv[3]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(LOG, "a") as f:
                f.write(json.dumps(body) + "\\n")
            if MODE == "hang":
                time.sleep(3600)
            rewards = [
                {"sample_id": s["sample_id"], "reward": len(s["response_tokens"]) / 32,
                 "metrics": {"prompt_len": len(s["prompt_tokens"])}}
                for s in body["samples"]
            ]
            data = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with open(READY, "w") as f:
        f.write(str(server.server_address[1]))
    server.serve_forever()
    """
)


class RewardService:
    """The reward service as its own process: `mode` "ok" scores, "hang" never answers."""

    def __init__(self, tmp_path: Path, mode: str):
        script, self.log, ready = tmp_path / "service.py", tmp_path / "service.jsonl", tmp_path / "service.port"
        script.write_text(SERVICE)
        self.proc = subprocess.Popen([sys.executable, str(script), mode, str(self.log), str(ready)])
        _until(lambda: ready.exists() and ready.read_text() != "", "the reward service to listen")
        self.url = f"http://127.0.0.1:{int(ready.read_text())}/score"

    def requests(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.slow
def test_a_reward_service_trains_a_run(engine, db_url, tmp_path):
    run, tokens = _sim_run(engine, "byo-url")
    with RewardService(tmp_path, "ok") as service:
        reward = ["--reward-url", service.url, "--reward-concurrency", "2", "--reward-request-size", "3"]
        with _cluster_run(tmp_path, db_url, run, tokens, reward, STEPS) as cluster:
            _until(lambda: _version(engine, run) >= STEPS, f"{STEPS} trained steps", cluster.check)
        requests = service.requests()
    trained = _trained(engine, run)
    assert trained
    for _, n, reward, metrics in trained:
        assert reward == n / 32 and metrics is not None and 8 <= metrics["prompt_len"] <= 16
    assert requests and all(r["run_id"] == run and 1 <= len(r["samples"]) <= 3 for r in requests)
    sample = requests[0]["samples"][0]
    assert set(sample) == {
        "run_id",
        "sample_id",
        "group_id",
        "prompt_tokens",
        "response_tokens",
        "prompt",
        "response",
        "finish_reason",
        "meta",
        "response_mask",
    }
    assert sample["response_mask"] == [1] * len(sample["response_tokens"])  # single-turn: all generated
    assert sample["meta"]["answer"] in ("0", "1", "2")
    assert summary(engine, run)["violations"] == []


def _audit_drops(db_url: str, run: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "staleflow_cli.main", "audit", str(run)],
        env={**os.environ, "STALEFLOW_DATABASE_URL": db_url, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    return out.stdout + out.stderr


@pytest.mark.slow
def test_a_failing_reward_drops_its_samples_as_reward_failed(engine, db_url, tmp_path, user_module):
    run, tokens = _sim_run(engine, "byo-broken", prompts=4)
    reward = ["--reward", f"{user_module}:broken", "--reward-retries", "1"]
    with _cluster_run(tmp_path, db_url, run, tokens, reward, None) as cluster:
        _until(lambda: _dropped(engine, run).get("reward_failed", 0) >= 4, "reward_failed drops", cluster.check)
        log = (tmp_path / "logs" / "reward.log").read_text()
    assert "my reward has a bug" in log
    calls = (tmp_path / "calls.txt").read_text().split()
    dropped = {int(c) for c in calls}
    assert sorted(calls.count(str(s)) for s in dropped) == [2] * len(dropped)  # a try and one retry each
    with engine.connect() as c:
        rewarded = c.execute(text("SELECT count(*) FROM samples WHERE run_id = :r AND reward IS NOT NULL"), {"r": run})
        assert rewarded.scalar() == 0  # never a silent 0
        kinds = c.execute(
            text("SELECT DISTINCT reason FROM prompt_groups WHERE run_id = :r AND state = 'aborted'"), {"r": run}
        )
        assert set(kinds.scalars()) <= {"insufficient_members"}  # their groups could not reach N
    assert "reward_failed" in _audit_drops(db_url, run)
    assert summary(engine, run)["violations"] == []


@pytest.mark.slow
def test_a_hanging_reward_service_times_out_and_drops(engine, db_url, tmp_path):
    run, tokens = _sim_run(engine, "byo-hang", prompts=2)
    with RewardService(tmp_path, "hang") as service:
        reward = ["--reward-url", service.url, "--reward-timeout", "0.5", "--reward-retries", "1"]
        with _cluster_run(tmp_path, db_url, run, tokens, reward, None) as cluster:
            _until(lambda: _dropped(engine, run).get("reward_failed", 0) >= 1, "a reward_failed drop", cluster.check)
            log = (tmp_path / "logs" / "reward.log").read_text()
        assert len(service.requests()) >= 2  # the first try and its retry
    assert "timed out after 0.5 s" in log
    assert "reward_failed" in _audit_drops(db_url, run)


def test_reward_options_are_refused_clearly(tmp_path):
    def refused(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "staleflow_cli.main", "reward-worker", "--run", "1", *args],
            env={**os.environ, "COLUMNS": "200", "PYTHONPATH": _pythonpath(tmp_path), "STALEFLOW_TOKEN": "x"},
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        return " ".join((proc.stdout + proc.stderr).split())

    (tmp_path / "m.py").write_text("x = 1\n")
    assert "exactly one of" in refused()
    assert "exactly one of" in refused("--verifier", "repeat", "--reward", "m:x")
    assert "module:function" in refused("--reward", "nocolon")
    assert "not callable" in refused("--reward", "m:x")
    assert "no module 'no_such_mod' on the Python path" in refused("--reward", "no_such_mod:f")
    assert "export PYTHONPATH=$PWD" in refused("--reward", "no_such_mod:f")
    (tmp_path / "bad.py").write_text("def (:\n")
    assert "SyntaxError" in refused("--reward", "bad:f")
    assert "--reward-batch goes with --reward" in refused("--verifier", "repeat", "--reward-batch")
    assert "http://" in refused("--reward-url", "ftp://x")
    assert "--linger" in refused("--verifier", "repeat", "--linger", "-1")
    assert "--linger" in refused("--verifier", "repeat", "--linger", "soon")
    port = free_port()
    assert "'Name: value'" in refused("--reward-url", f"http://127.0.0.1:{port}", "--reward-header", "nocolon")
