"""`staleflow trainer | ps | rollout-worker | reward-worker` as real subprocesses: help text,
clear refusals of bad arguments (before anything starts), the sim trainer end to end, and a
clean exit on SIGTERM (a rollout worker deregisters)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from api_helpers import REPO, ApiServer, token, walk_lifecycle
from typer.testing import CliRunner

from staleflow_cli.launch import free_port
from staleflow_cli.main import app

WAIT_S = 60  # guards against a hang, never a timing assertion
COMMANDS = ("trainer", "ps", "rollout-worker", "reward-worker")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STALEFLOW_TOKEN", "STALEFLOW_API_URL")}
    return {**env, "COLUMNS": "200", **extra}  # wide help: no wrapped option names


def staleflow(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "staleflow_cli.main", *args],
        cwd=REPO,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=WAIT_S * 2,
    )


def invoke(*args: str) -> subprocess.CompletedProcess:
    """The same command in this process (argument checks fail before anything starts; this
    saves a Python + torch start-up per case)."""
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "STALEFLOW_TOKEN": "", "STALEFLOW_API_URL": ""})
    return subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)


def _refused(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    out = " ".join((proc.stdout + proc.stderr).split())  # rich boxes wrap long messages
    assert proc.returncode == code, out
    for n in needles:
        assert n in out, out


def test_root_help_lists_the_worker_commands():
    out = staleflow("--help")
    assert out.returncode == 0
    for cmd in COMMANDS:
        assert cmd in out.stdout


def test_the_cli_and_the_sim_trainer_do_not_load_torch():
    # hosts running the data layer, the sim trainer or the reward worker need no torch
    code = (
        "import sys, staleflow_cli.main, workers.trainer.loop, workers.trainer.sim_trainer, workers.reward.worker, workers.rollout.engines.vllm_engine; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=WAIT_S).returncode == 0


@pytest.mark.parametrize(
    "cmd, options",
    [
        (
            "trainer",
            [
                "--run",
                "--api",
                "--token",
                "--ps",
                "--checkpoint-dir",
                "--steps",
                "--lr",
                "--sim",
                "--time-scale",
                "--model-config",
                "--tis-cap",
                "--clip-high",
                "--save-every",
                "--offline",
                "STALEFLOW_API_URL",
            ],
        ),
        ("ps", ["--run", "--data-dir", "--port", "--backend", "--ready-file", "STALEFLOW_TOKEN"]),
        (
            "rollout-worker",
            ["--run", "--engine", "--ps", "--kv-capacity", "--phi-wait", "--model-config", "--vllm-model"]
            + ["--engine-config", "--engine-arg"],
        ),
        ("reward-worker", ["--run", "--verifier", "--batch"]),
    ],
)
def test_help(cmd, options):
    out = invoke(cmd, "--help")
    assert out.returncode == 0, out.stderr
    for opt in options:
        assert opt in out.stdout


@pytest.mark.parametrize(
    "args, needles",
    [
        (["trainer"], ["Missing option '--run'"]),
        (["trainer", "--offline", "x", "--run", "1"], ["--offline", "no --run"]),
        (["trainer", "--offline", "/nonexistent"], ["--offline", "is not an export"]),
        (["trainer", "--run", "1", "--steps", "0"], ["--steps", "greater than or equal to 1"]),
        (["trainer", "--run", "1", "--ps", "nohostport"], ["--ps", "is not HOST:PORT"]),
        (["trainer", "--run", "1", "--model-config", "{nope"], ["--model-config"]),
        (["trainer", "--run", "1", "--model-config", '{"d_model": 30, "n_heads": 4}'], ["d_model must be divisible"]),
        (["trainer", "--run", "1", "--model-config", '{"layers": 3}'], ["--model-config", "layers"]),
        (["rollout-worker", "--run", "1", "--engine", "bogus"], ["--engine", "bogus", "torch", "sim", "vllm"]),
        (["rollout-worker", "--run", "1"], ["Missing option '--engine'"]),
        (["rollout-worker", "--run", "1", "--engine", "vllm"], ["--engine vllm needs --vllm-model"]),
        (
            ["rollout-worker", "--run", "1", "--engine", "sim", "--sim-model", "gpt9"],
            ["--sim-model", "no cost model", "qwen_7b"],
        ),
        (["ps", "--data-dir", "x"], ["Missing option '--run'"]),
        (["ps", "--run", "1"], ["Missing option '--data-dir'"]),
        (["ps", "--run", "1", "--data-dir", "x", "--backend", "mpi"], ["--backend", "mpi", "gloo", "nccl"]),
        (["reward-worker", "--run", "1", "--verifier", "nope"], ["unknown verifier 'nope'", "math", "repeat"]),
    ],
)
def test_bad_arguments_are_refused_clearly(args, needles):
    _refused(invoke(*args), *needles)


def test_nccl_without_gpus_is_refused():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _refused(invoke("ps", "--run", "1", "--data-dir", "x", "--backend", "nccl"), "nccl needs CUDA GPUs")


def test_unreachable_api_is_refused_when_not_waiting():
    # Without --api-wait a worker waits for the API for ever (tests/test_outages.py).
    _refused(
        invoke(
            "reward-worker",
            "--run",
            "1",
            "--verifier",
            "repeat",
            "--api",
            f"http://127.0.0.1:{free_port()}",
            "--api-wait",
            "0",
        ),
        "cannot reach the StaleFlow API",
    )


@pytest.fixture
def served(db_url):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        yield server, admin


def _fill_buffer(admin, run: int, version: int) -> None:
    """Make buffer `version` ready by hand: route, report and reward B groups."""
    B = admin.run_status(run).config.batch_size
    admin.enqueue(run, [(f"v{version}p{i}", [1, 2, 3 + i]) for i in range(B)])
    inst = admin.register(run, "scripted", version).instance_id
    queued = [q.sample_id for q in admin.snapshot(run).queued]
    admin.route(run, [(s, inst) for s in queued])
    work = admin.poll(run, inst, wait=5).work
    admin.report(
        run,
        inst,
        [
            {
                "sample_id": w.sample_id,
                "attempt": w.attempt,
                "route_token": w.route_token,
                "version": version,
                "tokens": [5, 6, 7],
                "logprobs": [-0.5] * 3,
            }
            for w in work
        ],
    )
    tasks = admin.claim(run, limit=100, wait=5)
    admin.record_rewards(run, [(t.sample_id, t.reward_attempt, float(t.sample_id % 2)) for t in tasks])
    admin.deregister(run, inst)


def test_connection_errors_name_the_culprit(served):
    server, admin = served
    run = admin.create_run("cli", batch_size=1, group_size=1, eta=0).id
    api = ["--api", server.url]
    _refused(invoke("trainer", "--run", "999", "--sim", *api, "--token", token(server.db_url, "admin")), "no run '999'")
    _refused(
        invoke("trainer", "--run", "nosuch", "--sim", *api, "--token", token(server.db_url, "admin")),
        "no run named 'nosuch'",
    )
    _refused(invoke("trainer", "--run", str(run), "--sim", *api, "--token", "sf_bogus"), "refused the token")
    _refused(invoke("trainer", "--run", str(run), "--sim", *api), "no token")
    if importlib.util.find_spec("vllm") is None:
        _refused(
            invoke(
                "rollout-worker",
                "--run",
                str(run),
                "--engine",
                "vllm",
                "--vllm-model",
                "some/model",
                *api,
                "--token",
                token(server.db_url, "rollout", run),
            ),
            "pip install 'staleflow[vllm]'",
            code=1,
        )
    if importlib.util.find_spec("workers.rollout.engines.sim_engine") is None:
        _refused(
            invoke(
                "rollout-worker",
                "--run",
                str(run),
                "--engine",
                "sim",
                *api,
                "--token",
                token(server.db_url, "rollout", run),
            ),
            "the sim engine",
            "not in this installation",
        )


def test_trainer_without_its_checkpoint_refuses_a_run_that_moved_on(served, tmp_path):
    pytest.importorskip("torch")
    server, admin = served
    run = admin.create_run("moved", batch_size=1, group_size=1, eta=0).id
    roles = {r: server.client(token(server.db_url, r, run)) for r in ("rollout", "reward", "trainer", "coordinator")}
    walk_lifecycle(admin, roles, run)  # someone else trained step 0
    proc = staleflow(
        "trainer",
        "--run",
        str(run),
        "--api",
        server.url,
        "--token",
        token(server.db_url, "trainer", run),
        "--checkpoint-dir",
        str(tmp_path / "empty"),
    )
    _refused(proc, f"run {run} is at version 1", "holds no trainer checkpoint", code=1)


def test_sim_trainer_trains_and_records_metrics(served, tmp_path):
    server, admin = served
    run = admin.create_run("sim", batch_size=2, group_size=1, eta=1).id
    _fill_buffer(admin, run, 0)
    metrics = tmp_path / "metrics.jsonl"
    proc = staleflow(
        "trainer",
        "--run",
        "sim",
        "--sim",
        "--time-scale",
        "0",
        "--steps",
        "1",
        "--api",
        server.url,
        "--metrics-file",
        str(metrics),
        STALEFLOW_TOKEN=token(server.db_url, "admin"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert admin.run_status(run).version == 1
    (m,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert (m["version"], m["groups"], m["samples"], m["response_tokens"]) == (0, 2, 2, 6)
    assert m["staleness"] == {"0": 2} and m["tokens"] == 6 + 2 * 3


def _until(cond, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert proc.poll() is None, f"{what}: exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_sigterm_exits_cleanly_and_deregisters(served, tmp_path):
    pytest.importorskip("torch")
    server, admin = served
    run = admin.create_run("term", batch_size=1, group_size=1, eta=0).id
    env = _env(STALEFLOW_API_URL=server.url, STALEFLOW_TOKEN=token(server.db_url, "admin"))
    procs = {
        "rollout": [
            "rollout-worker",
            "--run",
            str(run),
            "--engine",
            "torch",
            "--model-config",
            '{"vocab_size": 32, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq": 64}',
        ],
        "sim": ["rollout-worker", "--run", str(run), "--engine", "sim", "--time-scale", "0.01"],
        "reward": ["reward-worker", "--run", str(run), "--verifier", "repeat"],
        "trainer": ["trainer", "--run", str(run), "--sim", "--wait", "1"],
    }
    started = {
        k: subprocess.Popen(
            [sys.executable, "-m", "staleflow_cli.main", *a],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k, a in procs.items()
    }
    try:
        _until(
            lambda: admin.run_status(run).active_instances == 2, started["rollout"], "the rollout workers to register"
        )
        for p in started.values():
            assert p.poll() is None
            p.send_signal(signal.SIGTERM)
        for name, p in started.items():
            out, _ = p.communicate(timeout=WAIT_S)
            assert p.returncode == 0, f"{name}: {out}"
            assert "SIGTERM" in out
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
    assert admin.run_status(run).active_instances == 0  # both deregistered on the way out


def test_sigterm_with_the_api_gone_gives_up_after_a_lease(served):
    """A worker stopped after its API went away does not retry for ever: within a lease (15 s
    by default) its lease has lapsed anyway, so it logs what it could not send and exits."""
    server, admin = served
    run = admin.create_run("term-gone", batch_size=1, group_size=1, eta=0).id
    env = _env(STALEFLOW_API_URL=server.url, STALEFLOW_TOKEN=token(server.db_url, "admin"))
    worker = subprocess.Popen(
        [sys.executable, "-m", "staleflow_cli.main", "rollout-worker", "--run", str(run), "--engine", "sim"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _until(lambda: admin.run_status(run).active_instances == 1, worker, "the rollout worker to register")
        server.stop()
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=WAIT_S)
        assert worker.returncode == 0, out
        assert "deregister failed" in out
    finally:
        if worker.poll() is None:
            worker.kill()
