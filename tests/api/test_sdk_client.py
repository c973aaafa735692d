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
