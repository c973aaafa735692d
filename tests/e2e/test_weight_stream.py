"""Weights that fit: the trainer pushes in its push dtype, an engine pulls a version in
bounded buckets straight into its model (real PS process, real gloo, real torch models), a
failed pull never becomes the engine's version, and a tensor-parallel instance's rank 0
pulls once and broadcasts each bucket to the other ranks."""

from __future__ import annotations

import pytest
import torch
from ps_helpers import SPAWN, WAIT_S, publish

from workers.models.tiny_model import TinyConfig, TinyTransformer
from workers.rollout.engines.torch_engine import TorchEngine
from workers.rollout.engines.tp_pull import pull_shared
from workers.trainer.param_client import ParamClient
from workers.trainer.param_store import (
    ChecksumError,
    buckets,
    cast_dtype,
    flatten,
    layout,
    state_dict_checksum,
    tensors_of,
)
from workers.trainer.param_transport import RecvAccount

CFG = TinyConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=32)
BUCKET = 8 << 10  # bytes: the tiny model streams in a dozen buckets


def trained(seed: int = 11) -> dict[str, torch.Tensor]:
    """What the trainer holds: fp32 parameters."""
    return TinyTransformer(CFG, seed=seed).state_dict()


def identical(engine: TorchEngine, pushed: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
    """The engine's weights are bit for bit the pushed ones, in the pushed dtype."""
    got = engine.model.state_dict()
    want = {k: v.to(cast_dtype(v, dtype)) for k, v in pushed.items()}
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype
        and torch.equal(got[k].flatten().view(torch.uint8), want[k].flatten().view(torch.uint8))
        for k in want
    )


def test_bucket_plan_cuts_whole_tensors_within_the_bound():
    metas = layout({f"w{i}": (torch.bfloat16, (n,)) for i, n in enumerate([10, 300, 40, 40, 5000, 1, 0])})
    plan = buckets(metas, 600)
    assert [m for b in plan for m in b.metas] == metas  # every tensor once, in canonical order
    assert all(b.nbytes <= 600 or len(b.metas) == 1 for b in plan)  # only a lone big tensor exceeds it
    assert [b.start for b in plan[1:]] == [b.end for b in plan[:-1]] and plan[-1].end == sum(m.nbytes for m in metas)
    assert len(buckets(metas, None)) == 1 and buckets([], 600) == []
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="bucket_bytes"):
            buckets(metas, bad)  # type: ignore[arg-type]


def test_push_casts_floating_tensors_to_the_push_dtype_and_never_upcasts():
    sd = {"w": torch.randn(4, 3), "h": torch.randn(5).half(), "step": torch.tensor([3])}
    flat, metas = flatten(sd, dtype=torch.bfloat16)
    got = dict(tensors_of([(buckets(metas, None)[0], flat)]))
    assert {k: t.dtype for k, t in got.items()} == {"w": torch.bfloat16, "h": torch.bfloat16, "step": torch.int64}
    assert torch.equal(got["w"], sd["w"].bfloat16()) and torch.equal(got["h"], sd["h"].bfloat16())
    wide, metas = flatten(sd, dtype=torch.float32)  # fp16 stays fp16: no upcast
    assert {m.name: m.dtype for m in metas} == {"w": "F32", "step": "I64", "h": "F16"} and wide.numel() == flatten(sd)[
        0
    ].numel()
    assert state_dict_checksum(sd, torch.bfloat16) == state_dict_checksum(
        {k: v.to(got[k].dtype) for k, v in sd.items()}
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bucketed_pull_installs_the_pushed_weights_bit_for_bit_holding_one_bucket(start_ps, dtype):
    c = start_ps().client
    pushed = trained()
    c.commit(1, c.push(pushed, 1, dtype=dtype))  # the trainer's fp32 weights, pushed in `dtype`
    engine = TorchEngine(CFG, model_seed=0, dtype=dtype)
    account = RecvAccount()
    version, checksum = c.pull_into(
        lambda v, received: engine.install(v, tensors_of(received)), bucket_bytes=BUCKET, account=account
    )
    assert (version, engine.version) == (1, 1) and checksum == state_dict_checksum(pushed, dtype)
    assert identical(engine, pushed, dtype)
    # the transport's accounting: one buffer, one bucket at a time, the size of the largest bucket
    metas = layout({k: (cast_dtype(v, dtype), tuple(v.shape)) for k, v in pushed.items()})
    plan = buckets(metas, BUCKET)
    largest = max(m.nbytes for m in metas)
    assert len(plan) > 5 and account.buckets == len(plan)
    assert account.buffers == 1 and account.peak_in_flight == 1 and account.in_flight == 0
    assert account.buffer_bytes == account.peak_bytes == max(b.nbytes for b in plan) <= max(BUCKET, largest)
    assert account.received == sum(m.nbytes for m in metas) > 4 * account.buffer_bytes


def test_the_engine_pulls_from_the_ps_itself_as_the_rollout_worker_does(start_ps):
    c = start_ps().client
    publish(c, trained(1), 1)
    engine = TorchEngine(CFG, model_seed=0, dtype=torch.bfloat16)
    engine.ps, engine.bucket_bytes = c, BUCKET
    assert engine.weight_source(None) == (None, 1) and identical(engine, trained(1), torch.bfloat16)
    c.push(trained(2), 2)  # provisional: a pull command for it gets the latest committed one
    assert engine.weight_source(2) == (None, 2)
    engine.load_weights(None, 2)
    assert engine.version == 1
    c.commit(2, state_dict_checksum(trained(2)))
    engine.load_weights(None, 2)
    assert engine.version == 2 and identical(engine, trained(2), torch.bfloat16)


def test_a_hugging_face_model_trained_in_fp32_streams_into_a_bf16_engine_bit_for_bit(start_ps, tmp_path):
    """What the GPU check's pull_buckets case does on the GPU: a Hugging Face model (tied
    embeddings: the state dict names the shared tensor twice) trained in fp32, pushed in
    bf16, installed in place into the hf engine's bf16 model."""
    pytest.importorskip("transformers")
    from hf_helpers import make_tiny_hf_model

    from workers.models.hf import load_model
    from workers.rollout.engines.hf_engine import HFEngine

    folder = make_tiny_hf_model(tmp_path / "hf")
    trainer_model = load_model(folder)  # fp32, as the trainer trains it
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p))  # other weights than the folder's
    pushed = {k: v.detach() for k, v in trainer_model.state_dict().items()}
    c = start_ps().client
    c.commit(1, c.push(pushed, 1, dtype=torch.bfloat16))
    engine = HFEngine(folder, dtype="bfloat16")
    engine.ps, engine.bucket_bytes = c, 16 << 10
    assert engine.load_from_ps() == 1 and engine.version == 1
    got = engine.model.state_dict()
    assert got.keys() == pushed.keys()
    for k, t in pushed.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], t.bfloat16()), k


def _generate(engine: TorchEngine) -> list:
    engine.add_request("a", [1, 2, 3], max_new_tokens=4, seed=5)
    return [ev for _ in range(5) for ev in engine.step()]


def test_a_pull_that_fails_midway_never_becomes_the_engines_version(start_ps, tmp_path):
    """In place means no second copy, and so no old copy to fall back on: a pull that breaks
    (the PS dies mid-transfer) or arrives tampered leaves the version number where it was and
    the engine refusing to run until a whole version is installed."""
    ps = start_ps()
    publish(ps.client, trained(1), 1)
    engine = TorchEngine(CFG, model_seed=0)
    engine.install(1, iter(trained(1).items()))
    before = _generate(engine)
    publish(ps.client, trained(2), 2)

    def die_after_two_buckets(v, received):
        def two_then_kill():
            for n, (b, data) in enumerate(received):
                yield b, data
                if n == 1:
                    ps.proc.kill()  # the PS is gone with the rest of the version unsent
                    ps.proc.join(WAIT_S)

        engine.install(v, tensors_of(two_then_kill()))

    one_try = ParamClient(ps.client.addr, timeout_s=WAIT_S, retry_for=0)
    with pytest.raises(RuntimeError):  # PSUnavailable: the transfer broke
        one_try.pull_into(die_after_two_buckets, bucket_bytes=BUCKET)
    assert engine.version == 1
    assert not identical(engine, trained(1), torch.float32)  # torn: part of v2 is in
    with pytest.raises(RuntimeError, match="torn"):
        engine.step()
    # a PS that corrupts what it sends: the checksum at the end of the stream refuses it
    tampered = start_ps(_tamper_pulls=True)
    with pytest.raises(ChecksumError):
        tampered.client.pull_into(lambda v, r: engine.install(v, tensors_of(r)), bucket_bytes=BUCKET)
    assert engine.version == 1
    tampered.stop()
    # a whole version clears it
    good = start_ps()
    engine.ps = good.client
    assert engine.load_from_ps(None) == 2 and identical(engine, trained(2), torch.float32)
    engine.abort(["a"])
    engine.install(1, iter(trained(1).items()))
    assert _generate(engine) == before


# ---- tensor parallelism: one rank pulls, the others get each bucket by broadcast ----------
class _Group:
    """The GroupCoordinator surface tp_pull uses, over a plain torch.distributed group."""

    def __init__(self) -> None:
        self.rank_in_group = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        torch.distributed.broadcast(t, src=src)
        return t

    def broadcast_object(self, obj=None, src: int = 0):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]


def _tp_rank(rank: int, init: str, addr, out) -> None:
    try:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        engine = TorchEngine(CFG, model_seed=rank, dtype=torch.bfloat16)
        account = RecvAccount()

        def pull(load) -> int:  # only rank 0 reaches the PS
            return ParamClient(addr, timeout_s=WAIT_S).pull_served(load, None, bucket_bytes=BUCKET)[0]

        got = pull_shared(_Group(), pull, engine.install, "cpu", account)
        out.put((rank, got, engine.version, identical(engine, trained(), torch.bfloat16), account))
        torch.distributed.destroy_process_group()
    except Exception as e:  # report instead of dying silently
        out.put((rank, repr(e), None, None, None))


def test_tensor_parallel_ranks_share_one_pull_by_broadcast(start_ps, tmp_path):
    c = start_ps().client
    c.commit(3, c.push(trained(), 3, dtype=torch.bfloat16))
    out = SPAWN.Queue()
    init = f"file://{tmp_path / 'tp-rendezvous'}"
    procs = [SPAWN.Process(target=_tp_rank, args=(r, init, c.addr, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = out.get(timeout=WAIT_S)
        results[rank] = rest
    for p in procs:
        p.join(WAIT_S)
    assert results[0][:3] == [3, 3, True] and results[1][:3] == [3, 3, True], results
    follower = results[1][3]
    plan = buckets(layout({k: (torch.bfloat16, tuple(v.shape)) for k, v in trained().items()}), BUCKET)
    # the follower held one bucket at a time (its buffer grows to the largest bucket, the old
    # one dropped first), and never talked to the PS: rank 0's receive is the client's
    assert follower.buckets == len(plan) and follower.peak_in_flight == 1 and follower.in_flight == 0
    assert follower.buffer_bytes == follower.peak_bytes == max(b.nbytes for b in plan)
    assert results[0][3].buckets == 0
