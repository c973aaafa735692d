"""A multi-turn trajectory waiting for its environment, live: a real rollout worker (torch
engine, the guess environment with a step held open) over real HTTP to a real API process.
While the environment works, the stored heartbeat lists the trajectory with its turn's tokens
and its wait, outside the engine's running / waiting / KV counts, and the coordinator's view
built from the database does not count it against the instance's capacity; once the
environment answers, the trajectory is back in the queue (or finished) and off the instance."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from api_helpers import ApiServer, token

from staleflow_db.db import make_engine
from staleflow_db.protocol import Protocol
from workers.coordinator.routing import route_request_count
from workers.coordinator.service import instance_snapshots
from workers.coordinator.state import QueuedSample, SpeculativeState
from workers.envs.base import Step
from workers.envs.guess import GuessEnv
from workers.models.tiny_model import TinyConfig
from workers.rollout.engines.torch_engine import TorchEngine
from workers.rollout.turns import Turns
from workers.rollout.worker import RolloutWorker
from workers.tasks.guess import BOS, EOS, G, GuessCodec, GuessTask

# near-uniform next tokens over the guess vocabulary: a turn ends on EOS within a few tokens
CFG = TinyConfig(vocab_size=GuessTask().vocab_size, d_model=32, n_layers=1, n_heads=2, eos_token_id=EOS, head_std=0.1)


def _wait(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not reached: {what}")


def test_a_trajectory_waiting_for_its_environment_is_reported_and_holds_no_slot(db_url):
    gate = threading.Event()  # the environment's step answers only once it is set

    class SlowGuess(GuessEnv):
        def step(self, turn: str) -> Step:
            gate.wait(60)
            return super().step(turn)

    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("envwait", batch_size=1, group_size=1, eta=0, max_response_tokens=200).id
        admin.enqueue(run, [{"client_key": "g0", "prompt_tokens": [BOS, G], "meta": {"target": 7}}])
        engine = TorchEngine(CFG, model_seed=0, kv_capacity_tokens=4096, max_running=1)
        turns = Turns(SlowGuess, GuessCodec(), timeout_s=120)
        worker = RolloutWorker(
            server.client(token(db_url, "rollout", run)), run, engine, name="w", heartbeat_s=0.05, turns=turns
        )
        t = threading.Thread(target=worker.run, daemon=True)
        t.start()
        try:
            _wait(lambda: worker.instance_id is not None, "registered")
            (sid,) = [q.sample_id for q in admin.snapshot(run).queued]
            assert {r.outcome for r in admin.route(run, [(sid, worker.instance_id)])} == {"routed"}

            def stored():
                (inst,) = [i for i in admin.snapshot(run).instances if i.instance_id == worker.instance_id]
                return inst.snapshot

            hb = _wait(lambda: (s := stored()) and s.get("env_waiting") == 1 and s, "env waiting in a heartbeat")
            # the engine's counts leave it out; the trajectory's entry says its turn and its wait
            assert (hb["running"], hb["waiting"], hb["kv_used"]) == (0, 0, 0)
            (entry,) = hb["running_samples"]
            assert entry["sample_id"] == sid and entry["env_waited_s"] >= 0
            assert entry["turn_tokens"] == entry["tokens"] >= 1  # its first turn, ended by EOS

            # the coordinator's view, from the same database read the service makes
            eng = make_engine(db_url)
            try:
                (view,) = instance_snapshots(Protocol(eng).snapshot(run), time.time())
            finally:
                eng.dispose()
            (rs,) = view.running_samples
            assert rs.sample_id == sid and rs.in_env and rs.turn_tokens == entry["turn_tokens"]
            assert (view.env_waiting, view.running, view.kv_used, view.max_running) == (1, 0, 0, 1)
            st = SpeculativeState()
            st.observe(view)
            # its one slot is free: a queued sample would be routed there
            assert [r.sample_id for r in route_request_count(st.views(), [QueuedSample(999, 999, 2)])] == [999]

            gate.set()  # the environment answers: the trajectory leaves the instance
            _wait(lambda: worker.stats.turns + worker.stats.finished == 1, "the environment answered")
            _wait(
                lambda: (s := stored()) and s.get("env_waiting") == 0 and not s["running_samples"], "off the instance"
            )
            assert worker.stats.env_dropped == worker.stats.lost == 0
        finally:
            gate.set()
            worker.stop()
            t.join(30)
            turns.close()
