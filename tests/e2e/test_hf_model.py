"""A Hugging Face model folder end to end, without any download: a tiny Qwen2 with a locally
trained tokenizer (tests/hf_helpers.py), prompts tokenized through its chat template, and
every process real -- API, parameter server, `trainer --model`, reward worker,
`rollout-worker --engine hf --model`, coordinator. Steps are trained and published, the
engine generates with the published versions, and the audit is clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_helpers import assert_trained_hf_run, make_tiny_hf_model, train_hf_run
from typer.testing import CliRunner

from staleflow_cli.main import app
from workers.tasks.repeat import RepeatTask
from workers.trainer.torch_trainer import read_steps_log

STEPS = 3
TASK = RepeatTask(max_count=8, max_response=12)


@pytest.mark.slow
def test_hf_model_folder_runs_the_whole_loop(db_url, engine, tmp_path):
    # the engine's arguments as a GPU host would give them (the hf engine's subset)
    engine_toml = tmp_path / "engine.toml"
    engine_toml.write_text('dtype = "float32"\nmax_model_len = 200\nmax_num_seqs = 8\n')
    flags = ["--engine-config", str(engine_toml), "--engine-arg", "max_num_seqs=4", "--engine-arg", "device=cpu"]
    run, folder, checkpoint = train_hf_run(db_url, engine, tmp_path, STEPS, TASK, "cpu", flags)
    log = read_steps_log(checkpoint)
    assert [e["version"] for e in log if e["event"] == "trained"] == [1, 2, 3]
    assert_trained_hf_run(engine, run, folder, STEPS)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["rollout-worker", "--run", "1", "--engine", "hf"], ["--engine hf needs --model"]),
        (["rollout-worker", "--run", "1", "--engine", "hf", "--model", "/nonexistent"], ["not a Hugging Face model"]),
        (
            ["rollout-worker", "--run", "1", "--engine", "hf", "--model", "/x", "--engine-arg", "enforce_eager=true"],
            ["the hf engine does not take engine argument 'enforce_eager'", "dtype, device, max_model_len"],
        ),
        (
            ["rollout-worker", "--run", "1", "--engine", "hf", "--model", "/x", "--engine-arg", "dtype=auto"],
            ["hf engine dtype 'auto'"],
        ),
        (["trainer", "--run", "1", "--model", "/nonexistent"], ["not a Hugging Face model"]),
        (["trainer", "--run", "1", "--model", "x", "--sim"], ["no --sim, no --model-config"]),
        # a device this host lacks (no GPU here; fewer than 100 on a GPU host), before any connection
        (["trainer", "--run", "1", "--device", "bogus"], ["'bogus' is not a torch device"]),
        (["trainer", "--run", "1", "--device", "cuda:99"], ["--device", "cuda:99: this host has"]),
        (["rollout-worker", "--run", "1", "--engine", "torch", "--device", "cuda:99"], ["cuda:99: this host has"]),
        (
            ["rollout-worker", "--run", "1", "--engine", "hf", "--model", "/x", "--engine-arg", "device=cuda:99"],
            ["--engine-arg", "cuda:99: this host has"],
        ),
        (["demo", "--device", "cuda:99"], ["--device", "cuda:99: this host has"]),
    ],
)
def test_bad_model_options_are_refused_before_anything_starts(args, needles):
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200", "STALEFLOW_TOKEN": "", "STALEFLOW_API_URL": ""})
    out = " ".join((res.stdout + res.stderr).split())
    assert res.exit_code == 2, out
    for n in needles:
        assert n in out, out


@pytest.mark.slow
def test_demo_trains_a_model_folder(db_url, tmp_path):
    folder = make_tiny_hf_model(tmp_path / "model")
    args = ["demo", "--model", str(folder), "--steps", "2", "--instances", "1", "--batch-size", "2"]
    args += ["--group-size", "2", "--report-dir", str(tmp_path / "reports"), "--timeout", "240"]
    out = subprocess.run(
        [sys.executable, "-m", "staleflow_cli.main", *args],
        env={**os.environ, "STALEFLOW_DATABASE_URL": db_url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "staleness_violations: 0" in out.stdout
    (report,) = (tmp_path / "reports").iterdir()
    result = json.loads((report / "report.json").read_text())
    assert result["model"] == str(folder) and len(result["steps"]) == 2
