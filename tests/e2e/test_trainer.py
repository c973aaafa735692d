"""The trainer against a real API process and a real PS process, with the rollout and reward
side scripted through the client: versions advance, weights change and reach the PS, every
published version carries size/checksum/location; and a trainer SIGKILLed between its
checkpoint and its publish resumes without training a batch twice or skipping one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from api_helpers import REPO, ApiServer, token
from sqlalchemy import text

from staleflow_db.db import make_engine
from workers.models.tiny_model import TinyConfig, TinyTransformer
from workers.rollout.engines.base import FinishedEvent
from workers.rollout.engines.torch_engine import TorchEngine
from workers.trainer.param_auth import PSCredentials
from workers.trainer.param_client import ParamClient
from workers.trainer.torch_trainer import PAUSE_ENV, Trainer, load_checkpoint, read_steps_log
from workers.wire.models import BatchOut

CFG = TinyConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, max_seq=64)
B, N, ETA = 2, 2, 1
WAIT_S = 60  # guards against a hang, never a timing assertion


def _wait(cond, what: str, proc: subprocess.Popen | None = None, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "staleflow_cli.main", *args]


class PSProcess:
    """`staleflow ps` for `run` as its own process on a free port (it fetches the run's keys
    with a trainer token); `client` holds the trainer's key (tests push and pull with it)."""

    def __init__(self, data_dir: Path, server: ApiServer, run: int):
        self.ready = data_dir.parent / "ps-ready.json"
        self.log = open(data_dir.parent / "ps.log", "wb")
        trainer = token(server.db_url, "trainer", run)
        self.proc = subprocess.Popen(
            _cli("ps", "--run", str(run), "--data-dir", str(data_dir), "--port", "0", "--ready-file", str(self.ready)),
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STALEFLOW_API_URL": server.url, "STALEFLOW_TOKEN": trainer},
        )
        _wait(self.ready.exists, "the PS to serve", self.proc)
        info = json.loads(self.ready.read_text())
        self.addr = f"{info['host']}:{info['port']}"
        self.client = ParamClient(
            self.addr, timeout_s=WAIT_S, credentials=PSCredentials.fetch(server.client(trainer), run, "trainer")
        )

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(WAIT_S) == 0  # SIGTERM is a clean shutdown
        self.log.close()


class ScriptedRollout(threading.Thread):
    """The rollout instance, coordinator and reward worker, played through the REST client:
    route every queued sample, report a short response at the run's version, reward it with
    sample_id % 2 (members of a group have consecutive ids, so rewards differ)."""

    def __init__(self, server: ApiServer, run: int):
        super().__init__(daemon=True)
        self.client = server.client(token(server.db_url, "admin"))
        self.run_id = run
        self.instance = self.client.register(run, "scripted", 0).instance_id
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                self.tick()
                time.sleep(0.05)
        except BaseException as e:  # surfaced by stop()
            self.error = e

    def tick(self) -> None:
        c, run = self.client, self.run_id
        v = c.run_status(run).version
        c.heartbeat(run, self.instance, v, {"capacity": {"max_running": 64, "kv_capacity": 4096}})
        queued = [q.sample_id for q in c.snapshot(run).queued]
        if queued:
            c.route(run, [(s, self.instance) for s in queued])
        work = c.poll(run, self.instance, wait=0).work
        if work:
            c.report(
                run,
                self.instance,
                [
                    {
                        "sample_id": w.sample_id,
                        "attempt": w.attempt,
                        "route_token": w.route_token,
                        "version": v,
                        "tokens": [(w.sample_id + j) % 31 + 1 for j in range(2 + w.sample_id % 3)],
                        "logprobs": [-1.0 - 0.1 * j for j in range(2 + w.sample_id % 3)],
                        "finish_reason": "length",
                    }
                    for w in work
                ],
            )
        tasks = c.claim(run, limit=100, wait=0)
        if tasks:
            c.record_rewards(run, [(t.sample_id, t.reward_attempt, float(t.sample_id % 2)) for t in tasks])

    def stop(self) -> None:
        self._halt.set()
        self.join(WAIT_S)
        if self.error is not None:
            raise self.error


@pytest.fixture
def cluster(db_url, tmp_path):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("train", batch_size=B, group_size=N, eta=ETA, max_response_tokens=8).id
        admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(12)])
        (tmp_path / "ps").mkdir()
        ps = PSProcess(tmp_path / "ps", server, run)
        rollout = ScriptedRollout(server, run)
        rollout.start()
        try:
            yield server, admin, run, ps
        finally:
            rollout.stop()
            ps.stop()


def _db_rows(db_url: str, sql: str, **params):
    eng = make_engine(db_url)
    try:
        with eng.connect() as c:
            return c.execute(text(sql), params).all()
    finally:
        eng.dispose()


def test_trainer_scores_exactly_the_tokens_the_engine_sampled(tmp_path):
    """Alignment of prompt, response and rollout log-probs in the padded batch: with the
    engine's own weights, π_old equals π_rollout token for token (TIS weight 1)."""
    engine = TorchEngine(CFG, model_seed=3, kv_capacity_tokens=1024)
    prompts = {1: [1, 2, 3], 2: [1, 2, 3], 3: [4, 5, 6, 7, 8], 4: [4, 5, 6, 7, 8]}
    for sid, prompt in prompts.items():
        engine.add_request(str(sid), prompt, max_new_tokens=5 + 4 * sid, seed=sid)
    done = {}
    while engine.has_work():
        done.update({int(e.sample_id): e for e in engine.step() if isinstance(e, FinishedEvent)})
    groups = [
        {
            "group_id": g,
            "group_version": 0,
            "prompt_tokens": prompts[2 * g - 1],
            "meta": {},
            "samples": [
                {
                    "sample_id": s,
                    "idx": s % 2,
                    "v_traj": 0,
                    "tokens": done[s].tokens,
                    "logprobs": done[s].logprobs,
                    "reward": float(s % 2),
                    "finish_reason": done[s].finish_reason,
                    "segments": [],
                    "loss_mask": [1] * len(done[s].tokens),
                }
                for s in (2 * g - 1, 2 * g)
            ],
        }
        for g in (1, 2)
    ]
    batch = BatchOut(run_id=1, version=0, consume_fence=1, groups=groups)
    model = TinyTransformer(CFG, seed=3)
    trainer = Trainer(
        None, 1, model, torch.optim.SGD(model.parameters(), lr=0.0), checkpoint_dir=tmp_path, micro_batch_tokens=20
    )  # several micro batches of different widths
    loss, metrics = trainer.train_batch(batch)
    assert metrics["mismatch_mean"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["tis_mean"] == pytest.approx(1.0, abs=1e-3) and metrics["clip_frac"] == 0.0
    # ratio 1 and TIS 1: the token mean of -A, each sample weighing its response length
    lengths = [len(done[s].tokens) for s in (1, 2, 3, 4)]
    adv = [2**-0.5, -(2**-0.5)] * 2  # rewards (1, 0) per group: ±1/√2 (unbiased std)
    assert loss == pytest.approx(-sum(a * n for a, n in zip(adv, lengths)) / sum(lengths), rel=1e-3)


def test_trainer_advances_versions_pushes_and_publishes(cluster, tmp_path):
    server, admin, run, ps = cluster
    model = TinyTransformer(CFG, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = Trainer(
        server.client(token(server.db_url, "trainer", run)),
        run,
        model,
        opt,
        ps=ps.client,
        checkpoint_dir=tmp_path / "ckpt",
        wait_s=1.0,
    )

    steps = trainer.run(steps=2)

    assert [m.version for m in steps] == [0, 1]
    assert admin.run_status(run).version == 2
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    for m in steps:
        assert m.groups == B and m.samples == B * N and m.response_tokens > 0
        assert sum(m.staleness.values()) == B * N and all(0 <= s <= ETA for s in m.staleness)
        assert m.loss is not None and m.loss == m.loss  # finite
        assert {"clip_frac", "tis_mean", "ratio_mean", "entropy", "grad_norm"} <= set(m.extra)
        assert m.extra["ratio_mean"] == pytest.approx(1.0)  # π_old is the model before the step
    # the PS serves exactly the trained weights as version 2
    sd, version, checksum = ps.client.pull()
    assert version == 2 and checksum == steps[-1].checksum
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rows = {p.version: p for p in admin.param_versions(run)}
    for m in steps:
        row = rows[m.version + 1]
        assert (row.size_bytes, row.checksum, row.location) == (size, m.checksum, f"ps://{ps.addr}/v{m.version + 1}")
    assert rows[1].checksum != rows[2].checksum
    ck = load_checkpoint(tmp_path / "ckpt")
    assert ck["version"] == 2 and ck["checksum"] == steps[-1].checksum


def test_trainer_killed_between_checkpoint_and_publish_resumes_exactly_once(cluster, tmp_path):
    server, admin, run, ps = cluster
    ckpt = tmp_path / "ckpt"
    args = _cli(
        "trainer",
        "--run",
        str(run),
        "--api",
        server.url,
        "--token",
        token(server.db_url, "trainer", run),
        "--ps",
        ps.addr,
        "--checkpoint-dir",
        str(ckpt),
        "--model-config",
        json.dumps(CFG.to_dict()),
        "--lr",
        "1e-2",
        "--wait",
        "1",
    )
    env = {k: v for k, v in os.environ.items() if k != PAUSE_ENV}
    with open(tmp_path / "trainer1.log", "wb") as out:
        first = subprocess.Popen(
            [*args, "--steps", "3"], cwd=REPO, env={**env, PAUSE_ENV: "2"}, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            _wait((ckpt / "paused-v2").exists, "the trainer to checkpoint v2", first)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(WAIT_S)
    # buffer 1 was trained into v2 and checkpointed, but neither pushed nor published
    assert admin.run_status(run).version == 1
    assert ps.client.latest()["version"] == 1
    killed = read_steps_log(ckpt)
    (trained_v2,) = [e for e in killed if e["event"] == "trained" and e["version"] == 2]

    second = subprocess.run(
        [*args, "--steps", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=WAIT_S * 2
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "(resumed)" in second.stderr

    assert admin.run_status(run).version == 3
    entries = read_steps_log(ckpt)
    trained = [e["buffer"] for e in entries if e["event"] == "trained"]
    published = [e["version"] for e in entries if e["event"] == "published"]
    assert trained == [0, 1, 2]  # buffer 1 trained once, by the killed process
    assert published == [1, 2, 3]
    (pub_v2,) = [e for e in entries if e["event"] == "published" and e["version"] == 2]
    assert pub_v2["resumed"] and pub_v2["pid"] != trained_v2["pid"]
    # the database agrees: each buffer published once, in order, with the weights trained
    # before the crash for v2 (not retrained ones)
    assert [
        r.buffer
        for r in _db_rows(
            server.db_url, "SELECT buffer FROM events WHERE run_id = :r AND kind = 'published' ORDER BY id", r=run
        )
    ] == [0, 1, 2]
    rows = {p.version: p for p in admin.param_versions(run)}
    assert sorted(rows) == [1, 2, 3]
    assert rows[2].checksum == trained_v2["checksum"]
    latest = ps.client.latest()
    assert latest["version"] == 3 and latest["checksum"] == rows[3].checksum
    assert load_checkpoint(ckpt)["version"] == 3
