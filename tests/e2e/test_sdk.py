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
from hf_helpers import hf_run, make_tiny_hf_model, start_ps
from sqlalchemy import text

from staleflow_cli.launch import Cluster, wait_until
from staleflow_db.audit import summary
from staleflow_db.protocol import Protocol
from workers.models.hf import load_model
from workers.tasks.repeat import RepeatTask
from workers.trainer.param_server import state_dict_checksum

STEPS = 3
TASK = RepeatTask(max_count=8, max_response=12)


@pytest.mark.slow
def test_sdk_example_trains_an_hf_model(db_url, engine, tmp_path):
    folder = make_tiny_hf_model(tmp_path / "model")
    run, tokens = hf_run(engine, folder, "sdk", STEPS, TASK)
    protocol = Protocol(engine)
    common = ["--run", str(run)]
    with Cluster(tmp_path, db_url) as cluster:
        api = cluster.start_api(timeout=120)
        ps_addr = start_ps(cluster, tmp_path)
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
            cluster.spawn(
                "reward", ["reward-worker", *common, "--verifier", "repeat"], env={"STALEFLOW_TOKEN": tokens["reward"]}
            )
            cluster.spawn(
                "rollout",
                ["rollout-worker", *common, "--engine", "hf", "--model", str(folder), "--ps", ps_addr]
                + ["--kv-capacity", "1024", "--heartbeat", "0.5"],
                env={"STALEFLOW_TOKEN": tokens["rollout"]},
            )
            cluster.spawn(
                "coordinator", ["coordinator", *common, "--lease", "3"], env={"STALEFLOW_TOKEN": tokens["coordinator"]}
            )

            def finished() -> bool:
                cluster.check()
                return trainer.poll() is not None

            wait_until(finished, 400, 1.0, lambda: f"run at version {protocol.status(run)['version']} of {STEPS}")
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        output = log.read_text()
        assert trainer.returncode == 0, output[-3000:]
    assert [line.split(":")[0] for line in output.splitlines() if line.startswith("v")] == [
        "v0->v1",
        "v1->v2",
        "v2->v3",
    ]
    with engine.connect() as c:
        checksums = dict(
            c.execute(text("SELECT version, checksum FROM param_versions WHERE run_id = :r"), {"r": run}).all()
        )
        generated = c.execute(text("SELECT max(version) FROM segments WHERE run_id = :r"), {"r": run}).scalar()
    initial = state_dict_checksum(load_model(folder).state_dict())
    assert set(checksums) == {1, 2, 3}
    assert len({initial, *checksums.values()}) == 4  # every step changed the weights
    assert generated is not None and generated >= 1  # the engine pulled versions the SDK published
    audit = summary(engine, run)
    assert audit["violations"] == []
    assert len(audit["steps"]) == STEPS
