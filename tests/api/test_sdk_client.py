"""workers.sdk.TrainerClient against the real API: no batch yet is None (also with timeout
0), a publish without a consume is refused, and a trainer whose consume was fenced by a
later one gets TrainerError from publish instead of publishing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from api_helpers import ApiServer, token, walk_lifecycle

from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig
from workers.sdk import Batch, TrainerClient, TrainerError


def test_sdk_batches_and_fencing(db_url, engine):
    run = Protocol(engine).create_run("sdk", RunConfig(batch_size=1, group_size=2, eta=1))
    with ApiServer(db_url) as api:
        roles = {r: api.client(token(db_url, r, run)) for r in ("rollout", "reward", "trainer", "coordinator")}
        trainer = token(db_url, "trainer", run)
        first, second = TrainerClient(api.url, trainer, run), TrainerClient(api.url, trainer, run)
        assert first.version == 0 and first.next_batch(timeout=0) is None
        with pytest.raises(TrainerError, match="buffer 0 was not consumed"):
            first.publish(0, {})
        got: dict[str, Batch | None] = {}

        def both_consume():
            got["first"], got["second"] = first.next_batch(timeout=5), second.next_batch(timeout=5)
            assert got["second"] is not None
            return got["second"].raw  # walk_lifecycle publishes with the later consume fence

        walk_lifecycle(api.client(token(db_url, "admin")), roles, run, both_consume)
        batch = got["first"]
        assert batch is not None and len(batch) == 2 and batch.version == 0
        assert batch.versions.tolist() == [0, 0] and batch.rewards.shape == (2,)
        with pytest.raises(TrainerError, match="fenced"):
            first.publish(0, {"w": torch.zeros(2)})
        first.close()
        second.close()


def test_sdk_names_runs_carries_sampling_and_refuses_fresh_weights(db_url, engine):
    """By name: the batch carries the run's temperature and top_p; restarted on the run at
    version 1, `start` refuses weights that are not the published version's (the check
    `staleflow trainer` makes, workers.trainer.loop.check_start) unless `allow_fresh`."""
    Protocol(engine).create_run("tempered", RunConfig(batch_size=1, group_size=2, eta=1, temperature=0.5, top_p=0.95))
    with ApiServer(db_url) as api:
        admin = api.client(token(db_url, "admin"))
        run = admin.run_status("tempered").run_id
        roles = {r: api.client(token(db_url, r, run)) for r in ("rollout", "reward", "trainer", "coordinator")}
        trainer = token(db_url, "trainer", run)
        fresh = {"w": torch.zeros(2)}
        with TrainerClient(api.url, trainer, "tempered") as sf:
            assert (sf.run_id, sf.version, sf.temperature, sf.top_p) == (run, 0, 0.5, 0.95)
            sf.start(fresh)  # version 0: any weights start it
            got: dict[str, Batch] = {}

            def consume():
                batch = sf.next_batch(timeout=5)
                assert batch is not None
                got["batch"] = batch
                return batch.raw

            walk_lifecycle(admin, roles, run, consume)  # publishes version 1 (checksum "sha256:0")
        assert (got["batch"].temperature, got["batch"].top_p) == (0.5, 0.95)
        with TrainerClient(api.url, trainer, "tempered") as sf:
            assert sf.version == 1
            with pytest.raises(TrainerError, match="at version 1 but these weights are not its published version 1"):
                sf.start(fresh)
            sf.start(fresh, allow_fresh=True)


def test_sdk_pushes_in_its_push_dtype(db_url, engine, start_ps):
    """An fp32 model published through the SDK with push_dtype=bfloat16 travels and is served
    in bf16 (what a GPU trainer wants: half the bytes); integer tensors stay as they are."""
    run = Protocol(engine).create_run("sdk-dtype", RunConfig(batch_size=1, group_size=2, eta=1))
    ps = start_ps().client
    weights = {"w": torch.randn(8, 4), "step": torch.tensor([3])}
    with ApiServer(db_url) as api:
        with TrainerClient(api.url, token(db_url, "trainer", run), run, ps=ps, push_dtype=torch.bfloat16) as sdk:
            sdk.start(weights)
    got, version, _ = ps.pull()
    assert version == 0 and got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], weights["w"].bfloat16())
    assert torch.equal(got["step"], weights["step"])
