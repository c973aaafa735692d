"""`staleflow run ...` as real subprocesses against a real API server: a new user's path
(no --token: the admin token `staleflow serve` writes to $STALEFLOW_HOME/token), runs named
by name everywhere, the lifecycle from the command line, clear refusals; and the run's
sampling temperature is authoritative for the workers (a conflicting --temperature is
refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from api_helpers import REPO, ApiServer

from api.auth import ensure_local_token

WAIT_S = 60  # guards against a hang, never a timing assertion


def staleflow(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "staleflow_cli.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S * 2,
    )


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _refused(proc: subprocess.CompletedProcess, *needles: str, code: int = 1) -> None:
    out = " ".join((proc.stdout + proc.stderr).split())  # rich boxes wrap long messages
    assert proc.returncode == code, out
    for n in needles:
        assert n in out, out


def test_run_commands_for_a_new_user(db_url, engine, tmp_path):
    home = tmp_path / "home"
    ensure_local_token(engine, home)  # what `staleflow serve` does for the local user
    with ApiServer(db_url) as api:
        base = {k: v for k, v in os.environ.items() if k not in ("STALEFLOW_TOKEN", "STALEFLOW_API_URL")}
        env = {**base, "STALEFLOW_HOME": str(home), "STALEFLOW_API_URL": api.url, "COLUMNS": "200"}

        made = json.loads(
            _ok(
                staleflow(
                    "run",
                    "create",
                    "math-1",
                    "-B",
                    "2",
                    "-N",
                    "4",
                    "--eta",
                    "1",
                    "--temperature",
                    "0.8",
                    "--max-response-tokens",
                    "64",
                    "--json",
                    env=env,
                )
            )
        )
        assert (made["name"], made["state"], made["config"]["temperature"]) == ("math-1", "active", 0.8)
        assert made["config"]["max_response_tokens"] == 64 and made["config"]["buffer_capacity"] == 2
        _refused(
            staleflow("run", "create", "math-1", "-B", "1", "-N", "1", "--eta", "0", env=env),
            f"create run 'math-1': {made['id']}: a run named 'math-1' exists already",  # the existing run's id
        )
        _refused(staleflow("run", "create", "42", "-B", "1", "-N", "1", "--eta", "0", env=env), "all digits")

        listed = _ok(staleflow("run", "list", env=env))
        assert "math-1\tactive\tversion 0" in listed and "temperature=0.8" in listed
        shown = _ok(staleflow("run", "show", "math-1", env=env))
        assert shown.startswith(f"run {made['id']} (math-1): active, version 0")
        _refused(staleflow("run", "show", "nope", env=env), "run 'nope' does not exist")

        _ok(staleflow("run", "pause", "math-1", "--reason", "checking data", env=env))
        assert "paused (checking data), version 0" in _ok(staleflow("run", "show", str(made["id"]), env=env))
        _ok(staleflow("run", "resume", "math-1", env=env))
        cancelled = staleflow("run", "cancel", "math-1", env=env)
        assert "cancelled; 0 unfinished group(s) aborted" in " ".join(_ok(cancelled).split() + cancelled.stderr.split())
        _refused(staleflow("run", "resume", "math-1", env=env), "run", "is cancelled: it cannot become active")

        # without a token anywhere: what to do
        bare = {**env, "STALEFLOW_HOME": str(tmp_path / "empty")}
        _refused(staleflow("run", "list", env=bare), "no token", "staleflow serve")

        # the run's temperature is the workers': a different --temperature is refused
        _ok(staleflow("run", "create", "warm", "-B", "1", "-N", "1", "--eta", "0", env=env))
        worker = staleflow("rollout-worker", "--run", "warm", "--engine", "sim", "--temperature", "0.5", env=env)
        _refused(worker, "samples at temperature 1", "0.5 conflicts", code=2)
