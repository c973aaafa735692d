"""A trainer fenced off by another trainer's consume fence must never be told its publish
succeeded, and the PS must serve, under a published version, only the published weights:
the protocol (real PostgreSQL), the trainer's reaction over real HTTP, and a real PS process
with real tensors."""

from __future__ import annotations

import httpx
import pytest

torch = pytest.importorskip("torch")

from api_helpers import ApiServer, token
from protocol_helpers import Driver
from ps_helpers import same, state_dict

from staleflow_db.errors import Conflict
from workers.trainer.loop import TrainerError, publish_fenced
from workers.trainer.param_store import ChecksumError, ParamServerError, state_dict_checksum


def _ready_buffer(d: Driver) -> None:
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    d.complete(d.members(g), inst)


def test_a_fenced_trainers_replayed_publish_is_refused(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    _ready_buffer(d)
    zombie = d.p.consume(d.run, 0)
    winner = d.p.consume(d.run, 0)  # a second trainer takes the buffer over
    assert d.p.publish(d.run, 0, winner.consume_fence, size_bytes=10, checksum="B", location="ps://b") == 1
    # The zombie retries "its" publish: same version, its old fence -- not a replay of its own.
    with pytest.raises(Conflict, match="fenced: another trainer published version 1"):
        d.p.publish(d.run, 0, zombie.consume_fence, size_bytes=10, checksum="A", location="ps://a")
    with pytest.raises(Conflict, match="fenced"):
        d.p.publish(d.run, 0, zombie.consume_fence)  # even without a checksum
    # The winner's own retries stay no-ops; with another checksum it is not a retry.
    assert d.p.publish(d.run, 0, winner.consume_fence, size_bytes=10, checksum="B", location="ps://b") == 1
    assert d.p.publish(d.run, 0, winner.consume_fence) == 1
    with pytest.raises(Conflict, match="checksum"):
        d.p.publish(d.run, 0, winner.consume_fence, checksum="C")
    assert d.rows("SELECT version, checksum, location FROM param_versions WHERE run_id = :r") == [(1, "B", "ps://b")]
    assert d.scalars("SELECT version FROM runs WHERE id = :r") == [1]


def test_a_fenced_trainer_stops_with_a_clear_message_over_http(db_url, engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    _ready_buffer(d)
    with ApiServer(db_url) as server:
        zombie = server.client(token(db_url, "trainer", d.run))
        winner = server.client(token(db_url, "trainer", d.run))
        old = zombie.consume(d.run, 0, wait=0)
        new = winner.consume(d.run, 0, wait=0)
        assert publish_fenced(winner, d.run, 0, new.consume_fence, checksum="B") == 1
        with pytest.raises(TrainerError, match="fenced: another trainer published version 1"):
            publish_fenced(zombie, d.run, 0, old.consume_fence, checksum="A")
        # fenced before anyone published: the fence was lost to another consume
        d2 = Driver(engine, name="second", batch_size=1, group_size=1, eta=1)
        _ready_buffer(d2)
        trainer = server.client(token(db_url, "trainer", d2.run))
        old, new = trainer.consume(d2.run, 0, wait=0), trainer.consume(d2.run, 0, wait=0)
        with pytest.raises(TrainerError, match="fenced: another trainer consumed buffer 0"):
            publish_fenced(trainer, d2.run, 0, old.consume_fence)
        assert trainer.run_status(d2.run).version == 0


def test_a_replayed_publish_of_an_older_version_says_so(db_url, engine):
    """Two versions published; a publish of the first batch again is 409 naming it a replay of
    an older version (the version asked and the current one), and changes nothing."""
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    _ready_buffer(d)
    first = d.p.consume(d.run, 0)
    assert d.p.publish(d.run, 0, first.consume_fence, checksum="A") == 1
    inst = d.p.register_instance(d.run, "i1", 1)
    (g,) = d.enqueue(1)
    d.complete(d.members(g), inst, version=1)
    second = d.p.consume(d.run, 1)
    assert d.p.publish(d.run, 1, second.consume_fence, checksum="B") == 2
    published = d.rows("SELECT version, checksum FROM param_versions WHERE run_id = :r ORDER BY version")
    why = f"replay of an older version: batch 0 was published as version 1; run {d.run} is at version 2"
    with pytest.raises(Conflict) as refused:
        d.p.publish(d.run, 0, first.consume_fence, checksum="A")
    assert refused.value.items == [(0, why)]
    with ApiServer(db_url) as server:
        trainer = token(db_url, "trainer", d.run)
        for fence in (first.consume_fence, second.consume_fence):  # its own fence or not: an older version is no retry
            r = httpx.post(
                f"{server.url}/v1/runs/{d.run}/batches/0/publish",
                json={"consume_fence": fence, "checksum": "A"},
                headers={"Authorization": f"Bearer {trainer}"},
            )
            assert r.status_code == 409, r.text
            assert r.json()["error"]["items"] == [{"id": 0, "reason": why}]
            assert r.json()["error"]["message"] == f"0: {why}"
    assert d.rows("SELECT version, checksum FROM param_versions WHERE run_id = :r ORDER BY version") == published
    assert d.scalars("SELECT version FROM runs WHERE id = :r") == [2]


def test_the_ps_serves_only_the_published_weights_of_a_version(start_ps):
    ps = start_ps()
    c = ps.client
    zombie_sd, winner_sd = state_dict(11), state_dict(12)
    zombie_sum, winner_sum = state_dict_checksum(zombie_sd), state_dict_checksum(winner_sd)
    # The fenced trainer pushed v1 first; the winner's push of v1 replaces it (provisional).
    assert c.push(zombie_sd, 1) == zombie_sum
    assert c.push(winner_sd, 1) == winner_sum
    c.commit(1, winner_sum)  # the winner published v1 with its checksum
    assert c.latest()["committed"] is True
    # The zombie pushes again after the publish: refused, pullers keep the published bytes.
    with pytest.raises(ParamServerError, match="published"):
        c.push(zombie_sd, 1)
    with pytest.raises(ParamServerError, match="holds"):
        c.commit(1, zombie_sum)
    got, version, checksum = c.pull(1, checksum=winner_sum)
    assert (version, checksum) == (1, winner_sum) and same(got, winner_sd)
    with pytest.raises(ChecksumError):
        c.pull(1, checksum=zombie_sum)  # a puller naming other weights gets none
    # A restarted PS keeps the commit.
    ps.stop()
    again = start_ps().client
    with pytest.raises(ParamServerError, match="published"):
        again.push(zombie_sd, 1)
    got, _, checksum = again.pull()
    assert checksum == winner_sum and same(got, winner_sd)


def test_a_commit_of_other_weights_makes_the_winner_push_again(start_ps):
    """The zombie's push landed between the winner's push and its commit: the commit is
    refused, so the winner (workers.trainer.torch_trainer._commit_pushed) pushes again and commits."""
    c = start_ps().client
    winner_sd = state_dict(21)
    winner_sum = state_dict_checksum(winner_sd)
    c.push(winner_sd, 1)
    c.push(state_dict(22), 1)  # the zombie, still provisional
    with pytest.raises(ParamServerError, match="holds"):
        c.commit(1, winner_sum)
    c.push(winner_sd, 1)
    c.commit(1, winner_sum)
    got, _, checksum = c.pull(1)
    assert checksum == winner_sum and same(got, winner_sd)


def test_a_plain_pull_gets_only_committed_weights(start_ps):
    """Between a push and its commit the pushed version is provisional (perhaps a zombie's):
    a pull that names no checksum gets the latest committed version, never the provisional
    one -- also from a restarted PS -- and gets the new version once it is committed."""
    c = start_ps().client
    c.push(state_dict(30), 0)
    with pytest.raises(ParamServerError, match="latest committed None"):
        c.pull()  # pushed, never committed: nothing to serve yet
    c.commit(0, state_dict_checksum(state_dict(30)))
    winner_sd, zombie_sd = state_dict(31), state_dict(32)
    winner_sum = state_dict_checksum(winner_sd)
    c.push(winner_sd, 1)
    c.push(zombie_sd, 1)  # the zombie replaces the provisional v1 before the winner's commit
    got, version, _ = c.pull()
    assert version == 0 and same(got, state_dict(30))
    with pytest.raises(ParamServerError, match="not committed"):
        c.pull(1)
    with pytest.raises(ChecksumError):
        c.pull(1, checksum=winner_sum)  # a puller naming the published checksum gets none either
    with pytest.raises(ParamServerError, match="holds"):
        c.commit(1, winner_sum)
    c.push(winner_sd, 1)  # workers.trainer.torch_trainer._commit_pushed: push again, then commit
    got, version, checksum = c.pull(1, checksum=winner_sum)  # provisional, but the published bytes
    assert (version, checksum) == (1, winner_sum) and same(got, winner_sd)
    got, version, _ = c.pull()
    assert version == 0  # still not committed
    c.commit(1, winner_sum)
    for version_asked in (None, 1):
        got, version, checksum = c.pull(version_asked)
        assert (version, checksum) == (1, winner_sum) and same(got, winner_sd)


def test_a_restarted_ps_keeps_serving_the_committed_version_beside_a_provisional_one(start_ps):
    first = start_ps()
    c = first.client
    c.commit(1, c.push(state_dict(41), 1))
    c.push(state_dict(42), 2)  # provisional when the PS goes down
    first.stop()
    again = start_ps().client
    assert again.latest()["version"] == 2 and not again.latest()["committed"]
    got, version, _ = again.pull()
    assert version == 1 and same(got, state_dict(41))
    again.commit(2, state_dict_checksum(state_dict(42)))
    got, version, _ = again.pull()
    assert version == 2 and same(got, state_dict(42))
    assert sorted(p.name for p in (first.ready.parent / "ps").iterdir()) == ["v2.json", "v2.safetensors"]


def test_a_fenced_sim_trainer_process_exits_non_zero(db_url, engine, tmp_path):
    """`staleflow trainer --sim` consumes buffer 0 and "trains" for a while; meanwhile another
    trainer takes the buffer over and publishes. The first one's publish is refused: it exits
    1 with the fenced message instead of carrying on."""
    import subprocess
    import sys
    import time

    from api_helpers import REPO

    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    _ready_buffer(d)
    with ApiServer(db_url) as server:
        tok = token(db_url, "trainer", d.run)
        out = open(tmp_path / "trainer.log", "w+")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "staleflow_cli.main",
                "trainer",
                "--run",
                str(d.run),
                "--api",
                server.url,
                "--token",
                tok,
                "--sim",
                "--sim-overhead",
                "4",
                "--sim-s-per-token",
                "0",
                "--steps",
                "3",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while d.scalars("SELECT consume_fence FROM buffers WHERE run_id = :r AND idx = 0") != [1]:
                assert proc.poll() is None and time.monotonic() < deadline, "the trainer did not consume"
                time.sleep(0.05)
            winner = server.client(tok)
            batch = winner.consume(d.run, 0, wait=0)  # fence 2 fences the sim trainer
            assert winner.publish(d.run, 0, batch.consume_fence) == 1
            assert proc.wait(60) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
        out.seek(0)
        assert "fenced: another trainer published version 1" in " ".join(out.read().split())
    assert d.scalars("SELECT version FROM runs WHERE id = :r") == [1]


def test_a_rollout_workers_pull_lands_on_the_committed_checksum(db_url, engine, start_ps):
    """Run at version 1, published with the winner's checksum; on the PS a zombie's push has
    replaced the winner's provisional v1 before the winner's commit. A rollout worker told
    to pull v1 (real API, real PS, the CLI worker's weight source) keeps the committed v0;
    after the commit the same command loads exactly the published weights."""
    import threading
    import time

    from staleflow_cli.common import ps_client
    from workers.models.tiny_model import TinyConfig, TinyTransformer
    from workers.rollout.engines.torch_engine import TorchEngine
    from workers.rollout.worker import RolloutWorker

    cfg = TinyConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq=64)
    v0, winner, zombie = (TinyTransformer(cfg, seed=s).state_dict() for s in (0, 1, 2))
    c = start_ps().client
    c.commit(0, c.push(v0, 0))
    winner_sum = c.push(winner, 1)
    c.push(zombie, 1)
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    _ready_buffer(d)
    assert d.p.publish(d.run, 0, d.p.consume(d.run, 0).consume_fence, size_bytes=1, checksum=winner_sum) == 1

    pc = ps_client(f"{c.addr[0]}:{c.addr[1]}")
    answered: list[int] = []  # what each of the engine's pulls from the PS installed

    def pull_and_wait(n: int, loaded: int) -> None:
        # the engine pulls on the worker's thread: wait for the pull and its version
        admin.pull(d.run, [worker.instance_id], target_version=1)
        deadline = time.monotonic() + 60
        while len(answered) < n or eng.version != loaded:
            assert time.monotonic() < deadline, "the worker did not pull"
            time.sleep(0.05)

    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        eng = TorchEngine(cfg, model_seed=0, kv_capacity_tokens=1024)
        eng.ps = pc  # as `rollout-worker --ps` sets it: the engine streams versions itself
        load_from_ps = eng.load_from_ps

        def recorded(version=None, wait_s=0.0):
            answered.append(load_from_ps(version, wait_s))
            return answered[-1]

        eng.load_from_ps = recorded  # type: ignore[method-assign]
        worker = RolloutWorker(
            server.client(token(db_url, "rollout", d.run)), d.run, eng, weights=eng.weight_source, heartbeat_s=0.2
        )
        t = threading.Thread(target=worker.run, daemon=True)
        t.start()
        try:
            while worker.instance_id is None:
                time.sleep(0.05)
            pull_and_wait(1, loaded=0)
            assert answered == [0] and eng.version == 0  # not the zombie's v1
            assert state_dict_checksum(eng.model.state_dict()) == state_dict_checksum(v0)
            c.push(winner, 1)  # the winner's _commit_pushed: push again, commit
            c.commit(1, winner_sum)
            pull_and_wait(2, loaded=1)
            assert answered == [0, 1] and eng.version == 1
            assert state_dict_checksum(eng.model.state_dict()) == winner_sum
        finally:
            worker.stop()
            t.join(30)
