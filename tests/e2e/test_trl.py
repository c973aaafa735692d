"""TRL on StaleFlow end to end: docs/examples/train_trl.py (TRL's GRPOTrainer through
`workers.trainer.trl_adapter`) trains the tiny Hugging Face model folder against the real
service -- API, parameter server, `rollout-worker --engine hf`, reward worker, coordinator --
as separate processes. Every step publishes a version with new weights, the mean reward of
the last steps beats that of the first ones, and the audit is clean."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("trl")

from api_helpers import REPO
from hf_helpers import assert_trained_hf_run, hf_run, make_tiny_hf_model, spawn_hf_workers, start_ps

from staleflow_cli.launch import Cluster, wait_until
from staleflow_db.protocol import Protocol
from workers.tasks.repeat import RepeatTask

STEPS = 16
TASK = RepeatTask(max_count=8, max_response=12)
STEP_LINE = re.compile(r"^v(\d+)->v(\d+): \d+ samples reward (-?[\d.]+) staleness \[([\d, ]*)\]$", re.M)


@pytest.mark.slow
def test_trl_example_trains_an_hf_model(db_url, engine, tmp_path):
    folder = make_tiny_hf_model(tmp_path / "model")
    run, tokens = hf_run(engine, folder, "trl", STEPS, TASK, batch_size=4, group_size=4)
    protocol = Protocol(engine)
    with Cluster(tmp_path, db_url) as cluster:
        api = cluster.start_api(timeout=120)
        ps_addr = start_ps(cluster, tmp_path, run, tokens["trainer"])
        log = tmp_path / "trainer.log"
        with log.open("wb") as out:
            trainer = subprocess.Popen(
                [sys.executable, str(REPO / "docs/examples/train_trl.py"), "--run", str(run)]
                + ["--model", str(folder), "--ps", ps_addr, "--steps", str(STEPS), "--lr", "1e-2"]
                + ["--api", api, "--timeout", "300", "--out", str(tmp_path / "trl")],
                env={**os.environ, "STALEFLOW_TOKEN": tokens["trainer"]},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            spawn_hf_workers(cluster, run, folder, ps_addr, tokens)

            def finished() -> bool:
                cluster.check()
                return trainer.poll() is not None

            wait_until(finished, 600, 1.0, lambda: f"run at version {protocol.reads.status(run)['version']} of {STEPS}")
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        output = log.read_text()
        assert trainer.returncode == 0, output[-3000:]
    steps = STEP_LINE.findall(output)
    assert [(int(a), int(b)) for a, b, _, _ in steps] == [(v, v + 1) for v in range(STEPS)], output[-3000:]
    # every trained sample within η = 1 of the version it trains (the rollout runs ahead)
    staleness = [int(s) for *_, st in steps for s in st.split(",") if s.strip()]
    assert max(staleness) <= 1
    rewards = [float(r) for _, _, r, _ in steps]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print(f"mean reward: first 4 steps {first:.3f}, last 4 steps {last:.3f}")
    assert last > first + 0.1, rewards
    assert_trained_hf_run(engine, run, folder, STEPS)
