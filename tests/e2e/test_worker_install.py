"""A worker node as a user sets it up: a clean virtualenv with only the wheel's `worker` extra
(and torch, which the SDK's batches are made of) -- no SQLAlchemy, psycopg, FastAPI or Alembic
there at all. Against a real service (API and coordinator from the dev environment, on the test
database), a `sim` rollout worker, a reward worker and a trainer on the SDK run there for a few
steps, and none of them loads anything of the database or the API (staleflow_db, api).

Minutes (a virtualenv with torch); marked `wheel` like test_wheel.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from wheel_helpers import TORCH, build_wheel, clean_venv, pip_install, run

from staleflow_cli.launch import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.wheel, pytest.mark.timeout(1800)]

STEPS = 2
SERVER_STACK = {"sqlalchemy", "psycopg", "psycopg_pool", "alembic", "fastapi", "starlette", "uvicorn"}
FORBIDDEN = SERVER_STACK | {"prometheus_client", "staleflow_db", "api"}

# Runs a module as __main__ (a command's own code, its signal handling and exit included) and,
# when the process ends, writes the top-level packages it loaded to the file named first.
PROBE = """
import atexit, json, runpy, sys
out, module, *args = sys.argv[1:]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted({m.partition(".")[0] for m in sys.modules}))))
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

# A trainer on the SDK: consume STEPS batches, publish each (no parameter server: the sim
# engine needs no weights), then write what it loaded.
TRAINER = """
import json, sys
from workers.sdk import TrainerClient

out, api, token, run, steps = sys.argv[1:]
with TrainerClient(api, token, int(run), poll_s=2.0) as sf:
    for _ in range(int(steps)):
        batch = sf.next_batch(timeout=300)
        assert batch is not None, "no batch within 300 s"
        print(f"v{batch.version}: {len(batch)} samples, rewards {batch.rewards.tolist()}", flush=True)
        sf.publish(batch.version, {})
json.dump(sorted({m.partition(".")[0] for m in sys.modules}), open(out, "w"))
"""


def _loaded(path: Path, output: str) -> set[str]:
    assert path.exists(), f"{path.name} not written; the process's output ends:\n{output[-3000:]}"
    return set(json.loads(path.read_text()))


def test_worker_extra_runs_workers_and_the_sdk_without_server_code(tmp_path: Path, db_url: str, engine) -> None:
    from api.auth import create_token
    from staleflow_db.protocol import Prompt, Protocol
    from staleflow_db.types import RunConfig
    from workers.rollout.engines.sim_engine import encode_prompt

    wheel = build_wheel(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bin_dir, env = clean_venv(tmp_path / "venv", STALEFLOW_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    env.pop("STALEFLOW_DATABASE_URL", None)  # a worker node knows only the API
    pip_install(bin_dir, TORCH, cwd=elsewhere, env=env)
    pip_install(bin_dir, f"{wheel}[worker]", cwd=elsewhere, env=env)
    python = str(bin_dir / "python")
    absent = run(
        [python, "-c", f"import importlib.util as u; print([m for m in {sorted(SERVER_STACK)!r} if u.find_spec(m)])"],
        timeout=60,
        cwd=elsewhere,
        env=env,
    )
    assert absent.stdout.strip() == "[]", f"the worker extra installed {absent.stdout}"
    staleflow = str(bin_dir / "staleflow")
    assert "reward-worker" in run([staleflow, "--help"], timeout=60, cwd=elsewhere, env=env).stdout
    serve = subprocess.run([staleflow, "serve"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert serve.returncode == 1 and "pip install 'staleflow[server]'" in serve.stderr, serve.stdout + serve.stderr
    (elsewhere / "probe.py").write_text(PROBE)
    (elsewhere / "trainer.py").write_text(TRAINER)

    protocol = Protocol(engine)
    run_id = protocol.create_run("worker-node", RunConfig(batch_size=2, group_size=2, eta=1, max_response_tokens=32))
    protocol.enqueue(run_id, [Prompt(f"p{k}", encode_prompt(16, 12, 0.3), {}) for k in range(4 * STEPS * 2)])
    tokens = {r: create_token(engine, r, run_id)["token"] for r in ("trainer", "rollout", "reward", "coordinator")}

    workers: dict[str, subprocess.Popen] = {}
    with Cluster(tmp_path, db_url) as cluster:
        api = cluster.start_api(timeout=120)
        cluster.spawn(
            "coordinator", ["coordinator", "--run", str(run_id)], env={"STALEFLOW_TOKEN": tokens["coordinator"]}
        )
        commands = {
            "rollout": ["rollout-worker", "--engine", "sim", "--time-scale", "0.01", "--heartbeat", "0.5"],
            "reward": ["reward-worker", "--verifier", "sim"],
        }
        try:
            for role, args in commands.items():
                with (tmp_path / f"{role}.log").open("wb") as log:
                    workers[role] = subprocess.Popen(
                        [python, "probe.py", f"{role}.json", "staleflow_cli.main", *args, "--run", str(run_id)]
                        + ["--api", api],
                        cwd=elsewhere,
                        env={**env, "STALEFLOW_TOKEN": tokens[role]},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
            trained = subprocess.run(
                [python, "trainer.py", "trainer.json", api, tokens["trainer"], str(run_id), str(STEPS)],
                cwd=elsewhere,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            cluster.check()
            assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
            assert [line.split(":")[0] for line in trained.stdout.splitlines()] == [f"v{v}" for v in range(STEPS)]
            for proc in workers.values():  # a clean stop: each finishes its work and exits 0
                assert proc.poll() is None, f"a worker exited early ({proc.args})"
                proc.send_signal(signal.SIGTERM)
            for role, proc in workers.items():
                assert proc.wait(timeout=60) == 0, (tmp_path / f"{role}.log").read_text()[-3000:]
        finally:
            for proc in workers.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    assert protocol.reads.status(run_id)["version"] == STEPS
    loaded = {
        "trainer (SDK)": _loaded(elsewhere / "trainer.json", trained.stdout + trained.stderr),
        **{role: _loaded(elsewhere / f"{role}.json", (tmp_path / f"{role}.log").read_text()) for role in commands},
    }
    assert "workers" in loaded["rollout"] and "torch" in loaded["trainer (SDK)"]  # the probe sees imports
    for role, modules in loaded.items():
        assert not modules & FORBIDDEN, f"{role} loaded {sorted(modules & FORBIDDEN)}"
