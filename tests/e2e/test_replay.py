"""Replay and offline training from an export, on a run trained by `staleflow trainer` (the tiny
model, real API process, the rollout and reward side scripted through the client as in
test_trainer.py): `staleflow replay` recomputes each step's loss from the step's kept
checkpoint equal to the logged one and ends with the weights the trainer published;
`staleflow trainer --offline` trains the same batches into the same weights with no run; the
refusals name what does not fit."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from api_helpers import ApiServer, token

from tests.e2e.test_cli import staleflow
from tests.e2e.test_trainer import CFG, ScriptedRollout
from workers.export_read import Export, ExportError
from workers.models.tiny_model import TinyConfig, TinyTransformer
from workers.trainer.loop import TrainerError
from workers.trainer.replay import ReplayError, replay
from workers.trainer.torch_trainer import Trainer, load_checkpoint, read_steps_log, version_checkpoint

pytestmark = pytest.mark.slow  # a trainer process, an export and an offline trainer process

STEPS = 3
# two optimizer steps per batch and a decaying lr: the replay must get the optimizer state,
# the lr of the step and the minibatch split right, not only the first forward pass
# one torch thread: with more, the BLAS may use fewer under load (dynamic threading), so the
# weights' last bits, and their checksums, could differ between the trainer and the replay
TRAIN_ARGS = (
    *("--model-config", json.dumps(CFG.to_dict()), "--steps", str(STEPS)),
    *("--lr", "1e-2", "--lr-end", "0.5", "--minibatches", "2", "--threads", "1"),
)


@pytest.fixture
def trained(db_url, tmp_path):
    """A run trained STEPS steps with kept checkpoints, and its --trained export."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("replay", batch_size=2, group_size=2, eta=1, max_response_tokens=8).id
        admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(12)])
        rollout = ScriptedRollout(server, run)
        rollout.start()
        try:
            ckpt = tmp_path / "ckpt"
            env = {**os.environ, "STALEFLOW_API_URL": server.url, "STALEFLOW_TOKEN": token(db_url, "trainer", run)}
            staleflow(
                "trainer", "--run", str(run), "--checkpoint-dir", str(ckpt),
                "--save-every", "1", "--wait", "1", *TRAIN_ARGS, env=env,
            )  # fmt: skip
        finally:
            rollout.stop()
        offline_ckpt = tmp_path / "offline-ckpt"
        yield server, run, ckpt, tmp_path / "export", offline_ckpt


def _env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "250"}  # messages on one line


def _export(db_url: str, run: int, out: Path) -> None:
    staleflow("export", str(run), "--out", str(out), "--trained", env={**os.environ, "STALEFLOW_DATABASE_URL": db_url})


def test_replay_recomputes_the_logged_loss_and_offline_training_the_weights(trained, db_url, tmp_path):
    server, run, ckpt, out, offline_ckpt = trained
    _export(db_url, run, out)
    export = Export(out)
    assert export.steps() == list(range(STEPS))
    logged = {e["buffer"]: e for e in read_steps_log(ckpt) if e["event"] == "trained"}
    assert sorted(logged) == list(range(STEPS))
    # each published version carries its step's loss into the export (param_versions.train_metrics)
    published = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [p["step"] for p in published] == list(range(STEPS))
    for p in published:
        assert (
            p["train_metrics"]["loss"] == logged[p["step"]]["loss"] and p["checksum"] == logged[p["step"]]["checksum"]
        )

    # the documented command: step 1 from the checkpoint step 1 started from
    cli = staleflow(
        "replay", str(out), "--step", "1", "--checkpoint", str(version_checkpoint(ckpt, 1)), "--json",
        env=_env(),
    )  # fmt: skip
    got = json.loads(cli.stdout)
    assert got["logged_loss"] == logged[1]["loss"] and math.isfinite(got["loss"])
    assert got["loss"] == pytest.approx(logged[1]["loss"], rel=1e-6, abs=1e-7)
    assert got["checksum"] == logged[1]["checksum"]  # the whole update replayed: the weights of v2
    line = staleflow("replay", str(out), "--step", "1", "--checkpoint", str(version_checkpoint(ckpt, 1)), env=_env())
    assert "(export)" in line.stdout and "same as v2's" in line.stdout, line.stdout

    for step in range(STEPS):  # every step, in process; the logged loss from the export, then the trainer's log
        r = replay(export, step, version_checkpoint(ckpt, step))
        assert r.matches(rel=1e-6) and r.checksum == logged[step]["checksum"] and r.logged_in == "export", r.line()
        assert r.samples == 4 and r.metrics["optimizer_steps"] == 2
        from_log = replay(export, step, version_checkpoint(ckpt, step), steps_log=ckpt / "steps.jsonl")
        assert from_log.logged_in == str(ckpt / "steps.jsonl") and from_log.loss == r.loss

    # the batch alone, as consumed
    described = staleflow("replay", str(out), "--step", "0", env=_env()).stdout
    assert "step 0: 2 groups, 4 samples" in described
    batch = json.loads(staleflow("replay", str(out), "--step", "0", "--json", env=_env()).stdout)
    assert [g["group_id"] for g in batch["groups"]] == logged[0]["groups"]

    # offline: the same trainer on the export's batches, from the same initial weights
    offline = staleflow(
        "trainer", "--offline", str(out), "--checkpoint-dir", str(offline_ckpt), *TRAIN_ARGS, env=_env(),
    )  # fmt: skip
    assert f"{STEPS} step(s) trained offline" in offline.stderr, offline.stderr
    ck = load_checkpoint(offline_ckpt)
    assert ck["version"] == STEPS and ck["offline"]
    lines = [e for e in read_steps_log(offline_ckpt) if e["event"] == "trained"]
    assert [e["buffer"] for e in lines] == list(range(STEPS)) and all(math.isfinite(e["loss"]) for e in lines)
    fresh = TinyTransformer(CFG, seed=0).state_dict()
    assert any(not torch.equal(fresh[k], v) for k, v in ck["model"].items())  # weights changed
    # the same batches, settings and start: the same weights as the live trainer's, step by step
    assert [e["checksum"] for e in lines] == [logged[s]["checksum"] for s in range(STEPS)]
    again = staleflow(
        "trainer", "--offline", str(out), "--checkpoint-dir", str(offline_ckpt), *TRAIN_ARGS,
        env=_env(),
    )  # fmt: skip
    assert "0 step(s) trained offline" in again.stderr  # every step is trained: nothing left

    # a live trainer does not resume from an offline checkpoint, nor the offline one from a live one
    model = TinyTransformer(CFG, seed=0)
    live = Trainer(
        server.client(token(db_url, "trainer", run)), run, model, torch.optim.AdamW(model.parameters()),
        checkpoint_dir=offline_ckpt,
    )  # fmt: skip
    with pytest.raises(TrainerError, match="trained offline"):
        live.resume()
    bad = staleflow(
        "trainer", "--offline", str(out), "--checkpoint-dir", str(ckpt), *TRAIN_ARGS, env=_env(), check=False
    )
    assert bad.returncode == 1 and "live trainer's checkpoint" in bad.stderr

    _refusals(run, ckpt, out, tmp_path)  # on the same run: one trainer process for both


def _refusals(run: int, ckpt: Path, out: Path, tmp_path: Path) -> None:
    """Each names what does not fit: a step the export lacks, a checkpoint of another version,
    run or model, a file that is no checkpoint."""
    export = Export(out)
    env = _env()

    missing = staleflow(
        "replay", str(out), "--step", "7", "--checkpoint", str(version_checkpoint(ckpt, 1)), env=env, check=False
    )
    assert missing.returncode == 2 and f"holds steps 0..{STEPS - 1}, not step 7" in missing.stderr
    with pytest.raises(ExportError, match="not an export"):
        Export(tmp_path)
    wrong_version = staleflow(
        "replay", str(out), "--step", "1", "--checkpoint", str(version_checkpoint(ckpt, 2)), env=env, check=False
    )
    assert wrong_version.returncode == 2 and "holds model version 2" in wrong_version.stderr

    # an export without the step: the trained samples of step 0 only
    part = tmp_path / "part"
    shutil.copytree(out, part)
    pc, pq = pytest.importorskip("pyarrow.compute"), pytest.importorskip("pyarrow.parquet")
    for f in Export(part).files:
        table = pq.read_table(f)
        pq.write_table(table.filter(pc.equal(table["step"], 0)), f)
    with pytest.raises(ExportError, match="not step 1"):
        replay(Export(part), 1, version_checkpoint(ckpt, 1))

    # a checkpoint of another run, and one of another model
    ck = torch.load(version_checkpoint(ckpt, 1), weights_only=True)
    other_run = tmp_path / "other-run.pt"
    torch.save({**ck, "run_id": run + 100}, other_run)
    with pytest.raises(ReplayError, match=f"checkpoint of run {run + 100}, the export is of run {run}"):
        replay(export, 1, other_run)
    other_weights = tmp_path / "other-weights.pt"  # v2's weights posing as v1
    torch.save({**torch.load(version_checkpoint(ckpt, 2), weights_only=True), "version": 1}, other_weights)
    with pytest.raises(ReplayError, match="not those published as version 1"):
        replay(export, 1, other_weights)
    other_model = tmp_path / "other-model.pt"
    bigger = TinyConfig(**{**CFG.to_dict(), "d_model": 64})
    torch.save({**ck, "model_config": bigger.to_dict()}, other_model)
    refused = staleflow("replay", str(out), "--step", "1", "--checkpoint", str(other_model), env=env, check=False)
    assert refused.returncode == 2 and "do not fit its model" in refused.stderr
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ReplayError, match="not a trainer checkpoint"):
        replay(export, 1, tmp_path / "junk.pt")
