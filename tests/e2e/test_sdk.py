"""The trainer SDK end to end: docs/examples/train_hf_sdk.py (a plain PyTorch GRPO loop over
`workers.sdk.TrainerClient`) trains the tiny Hugging Face model folder against the real
service -- API, parameter server, `rollout-worker --engine hf`, reward worker, coordinator --
for a few steps; each step publishes a version with new weights and the audit stays clean."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from api_helpers import REPO
from hf_helpers import assert_trained_hf_run, hf_run, make_tiny_hf_model, spawn_hf_workers, start_ps

from staleflow_cli.launch import Cluster, wait_until
from staleflow_db.protocol import Protocol
from workers.tasks.repeat import RepeatTask

STEPS = 3
TASK = RepeatTask(max_count=8, max_response=12)


@pytest.mark.slow
def test_sdk_example_trains_an_hf_model(db_url, engine, tmp_path):
    folder = make_tiny_hf_model(tmp_path / "model")
    run, tokens = hf_run(engine, folder, "sdk", STEPS, TASK)
    protocol = Protocol(engine)
    with Cluster(tmp_path, db_url) as cluster:
        api = cluster.start_api(timeout=120)
        ps_addr = start_ps(cluster, tmp_path, run, tokens["trainer"])
        log = tmp_path / "trainer.log"
        with log.open("wb") as out:
            trainer = subprocess.Popen(
                [sys.executable, str(REPO / "docs/examples/train_hf_sdk.py"), "--run", str(run)]
                + ["--model", str(folder), "--ps", ps_addr, "--steps", str(STEPS), "--lr", "1e-3"]
                + ["--api", api, "--timeout", "300"],
                env={**os.environ, "STALEFLOW_TOKEN": tokens["trainer"]},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            spawn_hf_workers(cluster, run, folder, ps_addr, tokens)

            def finished() -> bool:
                cluster.check()
                return trainer.poll() is not None

            wait_until(finished, 400, 1.0, lambda: f"run at version {protocol.reads.status(run)['version']} of {STEPS}")
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        output = log.read_text()
        assert trainer.returncode == 0, output[-3000:]
        _sdk_refuses_fresh_weights(api, tokens["trainer"], protocol.reads.get_run(run).name, ps_addr, folder)
    assert [line.split(":")[0] for line in output.splitlines() if line.startswith("v")] == [
        "v0->v1",
        "v1->v2",
        "v2->v3",
    ]
    assert_trained_hf_run(engine, run, folder, STEPS)


def _sdk_refuses_fresh_weights(api: str, token: str, name: str, ps: str, folder) -> None:
    """Restarted on the run at version STEPS (named by its name), the SDK refuses the folder's
    fresh weights, takes the published ones (the PS's, checked against the published
    checksum), and trains on from fresh ones only when told to."""
    from workers.models.hf import load_model
    from workers.sdk import TrainerClient, TrainerError

    fresh = load_model(str(folder)).state_dict()
    with TrainerClient(api, token, name, ps=ps) as sf:
        assert sf.version == STEPS
        with pytest.raises(TrainerError, match=f"at version {STEPS} but these weights are not its published"):
            sf.start(fresh)
        sf.start(sf.published_weights())
        sf.start(fresh, allow_fresh=True)
