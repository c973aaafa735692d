"""Processes ride through outages of the database and the API (real processes, real servers).

- A whole `sim` run (API, coordinator, sim rollout worker, reward worker, sim trainer as
  `staleflow` subprocesses) through a PostgreSQL stop/start: nobody exits, every role makes
  progress afterwards (the version moves on only if all of them do), /readyz says 503 while the
  database is down and 200 after by itself, the audit is clean, and each process logs the
  outage once and its end once. A second coordinator started while the database is down
  waits for it instead of exiting.
- A rollout worker given two API replicas, started while both are down: it waits; it then
  works through the second; through an outage of both; and through the first alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api.auth import create_token
from staleflow_cli.launch import Cluster, free_port
from staleflow_db import migrate
from staleflow_db.audit import summary
from staleflow_db.db import make_engine
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from tests.api_helpers import REPO, ApiServer, token
from workers.client import StaleFlowClient, Unavailable, api_urls
from workers.rollout.engines.sim_engine import encode_prompt

WAIT_S = 60.0
OUTAGE_S = 3.0


def _until(cond, what: str, check=lambda: None, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        check()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _status(url: str) -> int:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code
    except httpx.TransportError:
        return 0


def _log(path: Path) -> str:
    return path.read_text(errors="replace")


@pytest.mark.slow
def test_sim_run_rides_through_a_database_restart(embedded_pg, tmp_path):
    embedded_pg.start()
    url = embedded_pg.url()
    migrate.upgrade(url)
    engine = make_engine(url)
    protocol = Protocol(engine)
    try:
        run = protocol.create_run(
            "outage", RunConfig(batch_size=2, group_size=2, eta=1, max_response_tokens=128, max_prompt_tokens=64)
        )
        protocol.enqueue(run, [Prompt(f"g{k}", encode_prompt(16, 24, 0.3)) for k in range(400)])
        tokens = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward")}
        version = lambda: protocol.reads.status(run)["version"]  # noqa: E731
        with Cluster(tmp_path, url, env={"STALEFLOW_SIM_TIME_SCALE": "0.01"}) as cluster:
            api = cluster.start_api()
            common = ["--run", str(run)]
            coord = cluster.spawn("coordinator", ["coordinator", *common, "--lease", "2"])
            workers = [
                cluster.spawn(
                    "reward", ["reward-worker", *common, "--verifier", "sim"], env={"STALEFLOW_TOKEN": tokens["reward"]}
                ),
                cluster.spawn(
                    "rollout",
                    ["rollout-worker", *common, "--engine", "sim", "--heartbeat", "0.25"],
                    env={"STALEFLOW_TOKEN": tokens["rollout"]},
                ),
                cluster.spawn(
                    "trainer",
                    ["trainer", *common, "--sim", "--sim-overhead", "0.1", "--sim-s-per-token", "0", "--wait", "1"],
                    env={"STALEFLOW_TOKEN": tokens["trainer"]},
                ),
            ]
            t0 = time.monotonic()
            _until(lambda: version() >= 1, "a version before the outage", cluster.check)
            print(f"first version after {time.monotonic() - t0:.1f}s")

            embedded_pg.stop()
            _until(lambda: _status(api) == 503, "/readyz to say 503", cluster.check)
            # A process started while the database is down waits for it.
            late = cluster.spawn("coordinator-late", ["coordinator", *common, "--lease", "2"])
            _until(lambda: "the database unavailable" in _log(late.log), "the late coordinator to wait", cluster.check)
            time.sleep(OUTAGE_S)
            cluster.check()
            t_down = time.monotonic()
            embedded_pg.start()
            print(f"database restarted in {time.monotonic() - t_down:.1f}s")

            t_up = time.monotonic()
            _until(lambda: _status(api) == 200, "/readyz to recover by itself", cluster.check)
            before = version()
            # every role has to work for two more versions: routes, generation, rewards, training
            _until(lambda: version() >= before + 2, "two versions after the outage", cluster.check)
            print(f"ready {t_up:.1f}; next version {time.monotonic() - t_up:.1f}s after the restart")
            cluster.check()  # every process is still there

            for p in [coord, *workers, cluster.procs[0]]:  # [0]: the API
                _until(lambda: "is back after" in _log(p.log), f"{p.name} to log the end of the outage", cluster.check)
                # the API's LISTEN connection has its own pair of lines
                text = "\n".join(line for line in _log(p.log).splitlines() if "LISTEN" not in line)
                assert text.count("unavailable (") == 1, f"{p.name} logged the outage start != once:\n{p.tail(40)}"
                assert text.count("is back after") == 1, f"{p.name} logged the outage end != once:\n{p.tail(40)}"
            # The late coordinator and the API's LISTEN connection reconnect on their own backoff
            # (up to ~1 s a try), which the two versions need not wait for.
            _until(lambda: "is back after" in _log(late.log), "the late coordinator to log the end of the outage")
            api_log = cluster.procs[0].log
            _until(lambda: "the LISTEN connection is back after" in _log(api_log), "the LISTEN connection to be back")
            assert _log(api_log).count("the LISTEN connection is back after") == 1
            metrics = httpx.get(f"{api}/metrics", timeout=10).text
            assert "staleflow_database_outages_total 1.0" in metrics
        assert summary(engine, run)["violations"] == []
    finally:
        engine.dispose()


def _spawn(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    with open(log, "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "staleflow_cli.main", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.slow
def test_rollout_worker_fails_over_between_api_replicas(db_url, tmp_path):
    first, second = ApiServer(db_url), ApiServer(db_url)
    admin_token = token(db_url, "admin")
    log = tmp_path / "rollout.log"
    worker = None
    engine = make_engine(db_url)
    run_id = Protocol(engine).create_run("failover", RunConfig(batch_size=1, group_size=1, eta=100))
    engine.dispose()
    try:
        # Started while both replicas are down: it waits instead of exiting.
        worker = _spawn(
            [
                "rollout-worker",
                "--run",
                str(run_id),
                "--engine",
                "sim",
                "--heartbeat",
                "0.25",
                "--api-url",
                first.url,
                "--api-url",
                second.url,
            ],
            log,
            STALEFLOW_TOKEN=admin_token,
            STALEFLOW_SIM_TIME_SCALE="0.01",
        )

        def alive() -> None:
            assert worker.poll() is None, f"the rollout worker exited:\n{_log(log)[-3000:]}"

        # a replica started before the worker's first call would make this a plain start
        _until(lambda: "waiting for the StaleFlow API" in _log(log), "the worker to wait for the API", alive)
        second.start()
        admin = second.client(admin_token)

        def serve_one(client, key: str) -> None:
            """Route one new sample to the worker and wait until it is finished."""
            client.enqueue(run_id, [(key, encode_prompt(8, 8, 0.1))])
            (inst,) = [i.instance_id for i in client.snapshot(run_id).instances]
            queued = [q.sample_id for q in client.snapshot(run_id).queued]
            assert [r.outcome for r in client.route(run_id, [(s, inst) for s in queued])] == ["routed"] * len(queued)
            done = admin_finished(client) + len(queued)
            _until(lambda: admin_finished(client) >= done, f"the worker to finish {key}", alive)

        def admin_finished(client) -> int:
            return client.run_status(run_id).samples.get("finished", 0)

        _until(lambda: admin.run_status(run_id).active_instances == 1, "the worker to register", alive)
        serve_one(admin, "through-second")

        second.stop()  # both replicas down while the worker runs
        time.sleep(OUTAGE_S)
        alive()
        first.start()
        serve_one(first.client(admin_token), "through-first")
        alive()
        text = _log(log)
        assert "waiting for the StaleFlow API" in text
        assert text.count("is back after") >= 1
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        first.close()
        second.close()


def test_api_urls_from_arguments_and_environment(monkeypatch):
    monkeypatch.setenv("STALEFLOW_API_URL", " http://a:1/, http://b:2 ")
    assert api_urls(None) == ["http://a:1", "http://b:2"]
    assert api_urls(["http://c:3,http://d:4", "http://c:3"]) == ["http://c:3", "http://d:4"]
    monkeypatch.setenv("STALEFLOW_API_URL", "")
    assert api_urls(None) == ["http://127.0.0.1:8000"]


def test_a_one_shot_client_gives_up_after_its_retry_window():
    down = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    client = StaleFlowClient(down, "sf_x", retry_for=0.3)
    with pytest.raises(Unavailable) as err:
        client.run_status(1)
    assert err.value.code == "unreachable"
    assert client.api.down  # and the outage is known to whoever watches the client


def test_the_api_starts_without_its_database_and_says_so():
    from tests.api_helpers import in_process

    with in_process(f"postgresql://nobody@127.0.0.1:{free_port()}/none", connect_timeout=1) as http:
        assert http.get("/healthz").status_code == 200
        ready = http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["database"] is False
        r = http.get("/v1/runs", headers={"Authorization": "Bearer sf_x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable"
        assert "staleflow_database_outages_total 1.0" in http.get("/metrics").text
