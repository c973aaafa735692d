"""The vLLM adapter's pump, interrupts, finishes and weight loads, with the GPU side of vLLM
replaced: `FakeLLM` stands in for AsyncLLM's engine core (one token per `produce` tick per
request). Its front end -- the output collector that merges DELTA outputs and the abort that
queues a final `finished=True, "abort"` output -- is vLLM's REAL OutputProcessor and
RequestOutputCollector where vLLM imports (the pinned 0.32.0, `pip install -e '.[vllm]'`, or
0.33 in an environment of its own, since it needs torch 2.14: these classes run on CPU), and a
minimal copy of their semantics otherwise; every engine test runs on each front end available. Nothing here needs a GPU; bench/gpu_check.py covers the rest.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from types import SimpleNamespace

import pytest

from workers.rollout.engines.base import FINISH_REASONS, FinishedEvent, Partial, TokensEvent
from workers.rollout.engines.vllm_engine import VLLM_FINISH_REASONS, StaleFlowWorkerExtension, VLLMEngine

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed: `make test-vllm` runs these against vLLM 0.32.0 in .venv-vllm"
)


def token(rid: str, k: int) -> tuple[int, float]:
    """The fake core's k-th token of a request and its log-prob."""
    return 3 + (k * 7 + len(rid)) % 40, -0.01 * (k + 1)


# ---- front ends: what AsyncLLM does with the core's outputs before our adapter sees them ----
class SimpleFrontend:
    """vLLM's collector semantics in a few lines: DELTA outputs merge while unread; abort()
    queues a final empty output with finished=True and "abort"."""

    class Collector:
        def __init__(self) -> None:
            self.out: SimpleNamespace | None = None
            self.ready = asyncio.Event()

        def put(self, o: SimpleNamespace) -> None:
            if self.out is None:
                self.out = o
            else:  # merge (vLLM's RequestOutput.add with aggregate=True)
                c, n = self.out.outputs[0], o.outputs[0]
                c.token_ids += n.token_ids
                c.logprobs += n.logprobs
                c.finish_reason, self.out.finished = n.finish_reason, o.finished
            self.ready.set()

        def get_nowait(self) -> SimpleNamespace | None:
            o, self.out = self.out, None
            self.ready.clear()
            return o

        async def get(self) -> SimpleNamespace:
            while self.out is None:
                await self.ready.wait()
            o = self.get_nowait()
            assert o is not None
            return o

    def __init__(self) -> None:
        self.queues: dict[str, SimpleFrontend.Collector] = {}

    def add(self, rid: str, prompt: list[int], params: object) -> Collector:
        self.queues[rid] = q = self.Collector()
        return q

    def emit(self, rid: str, tokens: list[int], lps: list[float], reason: str | None) -> None:
        maps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, lps)]
        comp = SimpleNamespace(token_ids=list(tokens), logprobs=maps, finish_reason=reason)
        q = self.queues[rid] if reason is None else self.queues.pop(rid)
        q.put(SimpleNamespace(request_id=rid, outputs=[comp], finished=reason is not None))

    def abort(self, rid: str) -> bool:
        if rid not in self.queues:
            return False
        self.emit(rid, [], [], "abort")
        return True


class RealFrontend:
    """vLLM's own OutputProcessor and RequestOutputCollector, fed EngineCoreOutputs."""

    def __init__(self) -> None:
        from vllm.v1.engine.output_processor import OutputProcessor

        self.op = OutputProcessor(None, log_stats=False)

    def add(self, rid: str, prompt: list[int], params: object) -> object:
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.output_processor import RequestOutputCollector

        req = EngineCoreRequest(
            request_id=f"{rid}-internal",  # vLLM's AsyncLLM suffixes the id; outputs carry ours
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=rid,
        )
        q = RequestOutputCollector(params.output_kind, req.request_id)  # type: ignore[attr-defined]
        self.op.add_request(req, None, None, 0, q)
        return q

    def emit(self, rid: str, tokens: list[int], lps: list[float], reason: str | None) -> None:
        import numpy as np
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.outputs import LogprobsLists

        lp = LogprobsLists(
            np.array([[t] for t in tokens], dtype=np.int64).reshape(len(tokens), 1),
            np.array([[x] for x in lps], dtype=np.float32).reshape(len(tokens), 1),
            np.zeros(len(tokens), dtype=np.int64),
        )
        fin = None if reason is None else FinishReason[reason.upper()]
        self.op.process_outputs(
            [EngineCoreOutput(f"{rid}-internal", list(tokens), new_logprobs=lp if tokens else None, finish_reason=fin)]
        )

    def abort(self, rid: str) -> bool:
        return bool(self.op.abort_requests([rid], internal=False))


FRONTENDS = [pytest.param(SimpleFrontend, id="simple"), pytest.param("real", id="vllm", marks=needs_vllm)]


class FakeLLM:
    """AsyncLLM with its engine core replaced: requests make tokens only when `produce` runs."""

    def __init__(self, frontend: object, max_model_len: int = 64) -> None:
        self.front = frontend
        mc = SimpleNamespace(max_model_len=max_model_len)
        self.vllm_config = SimpleNamespace(
            model_config=mc,
            cache_config=SimpleNamespace(num_gpu_blocks=8, block_size=16),
            scheduler_config=SimpleNamespace(max_num_seqs=3),
        )
        self.running: dict[str, list[int]] = {}  # request id -> [max_tokens, produced]
        self.registration = asyncio.Event()
        self.registration.set()
        self.calls: list[tuple] = []
        self.rpc_results: list[list[int]] = []
        self.reset_ok = True
        self.errored = False  # AsyncLLM.errored: the engine is dead

    async def add_request(self, rid: str, prompt: dict, params: object) -> object:
        assert prompt["type"] == "token"  # `vllm.inputs.tokens_input` (0.32 and 0.33), not a raw TokensPrompt
        await self.registration.wait()
        if 999 in prompt["prompt_token_ids"]:
            raise ValueError("refused by the input processor")
        q = self.front.add(rid, prompt["prompt_token_ids"], params)  # type: ignore[attr-defined]
        self.running[rid] = [params.max_tokens, 0]  # type: ignore[attr-defined]
        return q

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.calls.append(("abort", ids))
        for rid in ids:
            self.front.abort(rid)  # type: ignore[attr-defined]
            self.running.pop(rid, None)

    async def produce(self, ticks: int = 1) -> None:
        for _ in range(ticks):
            for rid, st in list(self.running.items()):
                t, lp = token(rid, st[1])
                st[1] += 1
                done = st[1] >= st[0]
                self.front.emit(rid, [t], [lp], "length" if done else None)  # type: ignore[attr-defined]
                if done:
                    del self.running[rid]
            await asyncio.sleep(0.005)  # let the adapter's drain tasks run

    async def finish(self, rid: str, reason: str) -> None:
        """The core ends a request on its own (vLLM's abort/error/repetition/ignored)."""
        self.running.pop(rid)
        self.front.emit(rid, [], [], reason)  # type: ignore[attr-defined]
        await asyncio.sleep(0.005)

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None) -> list:
        self.calls.append(("rpc", method, args))
        return self.rpc_results.pop(0)

    async def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset",))
        return self.reset_ok

    def shutdown(self) -> None:
        pass


def engine(frontend: object, ps_addr: str | None = None) -> tuple[VLLMEngine, FakeLLM]:
    if frontend == "real":
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        front: object = RealFrontend()
        names = (SamplingParams, tokens_input, RequestOutputKind.DELTA)
    else:
        front = SimpleFrontend()
        names = (SimpleNamespace, lambda ids: {"type": "token", "prompt_token_ids": ids}, "delta")
    fake = FakeLLM(front)

    async def create() -> FakeLLM:
        fake.registration = asyncio.Event()  # bound to the adapter's loop
        fake.registration.set()
        return fake

    eng = VLLMEngine.__new__(VLLMEngine)
    eng._start(create, *names, version=0, temperature=1.0, poll_s=0.01, ps_addr=ps_addr)
    return eng, fake


def drain(eng: VLLMEngine, rounds: int = 5) -> list:
    out = []
    for _ in range(rounds):
        out += eng.step()
    return out


def toks(events: list, sid: str) -> list[int]:
    return [t for e in events if isinstance(e, TokensEvent) and e.sample_id == sid for t in e.tokens]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_interrupt_returns_every_sample_with_its_unread_tokens(frontend):
    """vLLM's abort queues a final finished=True "abort" output (merged with any tokens not
    read yet); it ends the stretch without ending the sample: 20 of 20 come back as partials."""
    eng, fake = engine(frontend)
    sids = [str(i) for i in range(20)]
    for s in sids:
        eng.add_request(s, [1, 2, 3], max_new_tokens=30, seed=int(s))
    eng._call(fake.produce(2))
    seen = drain(eng)
    eng._call(fake.produce(1))  # one more token each, not read by step() before the interrupt
    parts = eng.interrupt(sids)
    assert sorted(p.sample_id for p in parts) == sorted(sids)
    for p in parts:
        want = [token(f"{p.sample_id}#{sids.index(p.sample_id)}", k) for k in range(3)]
        assert p.tokens == [t for t, _ in want] and p.logprobs == pytest.approx([lp for _, lp in want])
        assert toks(seen, p.sample_id) == p.tokens[:2]
    assert not eng.has_work() and not fake.running
    assert drain(eng, 2) == []  # nothing of the stopped stretches leaks out later


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_interrupt_before_vllm_registered_the_request_stops_it(frontend):
    eng, fake = engine(frontend)
    eng._loop.call_soon_threadsafe(fake.registration.clear)
    time.sleep(0.02)
    eng.add_request("5", [1, 2], max_new_tokens=8)
    time.sleep(0.02)
    assert "5#0" not in fake.running  # still being registered
    eng._loop.call_soon_threadsafe(fake.registration.set)  # it registers while we interrupt
    assert eng.interrupt(["5"]) == [Partial("5", [], [], 0)]
    assert "5#0" not in fake.running and ("abort", ["5#0"]) in fake.calls  # aborted, holds no KV
    eng._call(fake.produce(2))
    assert drain(eng, 2) == [] and not eng.has_work()


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("reason", ["abort", "error", "repetition"])
def test_engine_side_stops_surface_as_finishes(frontend, reason):
    eng, fake = engine(frontend)
    eng.add_request("1", [1, 2], prefix_tokens=[9], max_new_tokens=10)
    eng._call(fake.produce(2))
    eng._call(fake.finish("1#0", reason))
    events = drain(eng)
    (fin,) = [e for e in events if isinstance(e, FinishedEvent)]
    assert fin.finish_reason == reason and fin.tokens == toks(events, "1") and len(fin.tokens) == 2
    assert fin.prefix_len == 1 and not eng.has_work()
    assert eng.interrupt(["1"]) == []


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_held_sample_and_an_empty_prompt_are_refused(frontend):
    eng, _ = engine(frontend)
    eng.add_request("1", [1, 2], max_new_tokens=3)
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request("1", [1, 2], max_new_tokens=3)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request("2", [], max_new_tokens=3)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_length_eos_and_a_prompt_that_never_fits(frontend):
    eng, fake = engine(frontend)
    eng.add_request("1", [1, 2], max_new_tokens=3)
    eng._call(fake.produce(3))
    eng.add_request("2", [1, 2], max_new_tokens=3)
    eng._call(fake.finish("2#1", "length"))  # vLLM never scheduled it: "length", no token
    fins = {e.sample_id: e for e in drain(eng) if isinstance(e, FinishedEvent)}
    assert fins["1"].finish_reason == "length" and len(fins["1"].tokens) == 3
    assert fins["2"] == FinishedEvent("2", [], [], "capacity", 0)
    # longer than the model: refused before vLLM (its input processor would raise)
    eng.add_request("3", list(range(1, 65)), max_new_tokens=3)
    assert eng.step() == [FinishedEvent("3", [], [], "length", 0)]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_request_vllm_refuses_ends_as_error_and_a_dead_engine_raises(frontend):
    eng, fake = engine(frontend)
    eng.add_request("1", [1, 999], max_new_tokens=3)
    assert drain(eng, 3) == [FinishedEvent("1", [], [], "error", 0)] and not eng.has_work()
    fake.errored = True
    eng.add_request("2", [1, 999], max_new_tokens=3)
    with pytest.raises(RuntimeError, match="refused by the input processor"):
        drain(eng, 3)


def test_weight_load_pauses_pulls_on_every_worker_and_checks_the_cache():
    eng, fake = engine(SimpleFrontend, ps_addr="10.0.0.1:7000")
    fake.rpc_results = [[3, 3]]
    eng.load_weights(None, 3)
    assert eng.version == 3
    assert fake.calls == [
        ("pause", "keep", True),
        ("rpc", "staleflow_pull", ("10.0.0.1:7000", 3, 0.0, None, None)),
        ("reset",),
        ("resume",),
    ]
    # two tensor-parallel ranks raced a commit: both load the newer one
    fake.calls, fake.rpc_results = [], [[4, 5], [5, 5]]
    assert eng.weight_source(None) == (None, 5) and eng.version == 5
    assert fake.calls[2] == ("rpc", "staleflow_pull", ("10.0.0.1:7000", 5, 0.0, None, None))
    assert eng.weight_source(7) == (None, 7)  # the rollout worker then calls load_weights
    fake.calls, fake.rpc_results, fake.reset_ok = [], [[6, 6]], False
    with pytest.raises(RuntimeError, match="prefix-cache"):
        eng.load_from_ps(6)
    assert fake.calls[-1] == ("resume",) and eng.version == 5


def test_weight_load_needs_a_parameter_server():
    eng, _ = engine(SimpleFrontend)
    with pytest.raises(RuntimeError, match="ps_addr"):
        eng.load_weights({}, 1)


def test_workers_pull_from_the_parameter_server_themselves(tmp_path):
    """The worker extension against a real PS: the target if committed, else the latest
    committed one; installed through the worker's reload_weights."""
    torch = pytest.importorskip("torch")
    from workers.trainer.param_client import ParamClient
    from workers.trainer.param_server import ParamServer

    ps = ParamServer(tmp_path)
    host, port = ps.start()
    try:
        pc = ParamClient((host, port))
        got: list = []
        worker = StaleFlowWorkerExtension()
        worker.device = "cpu"  # type: ignore[attr-defined]
        worker.reload_weights = lambda weights_iterator: got.append(dict(weights_iterator))  # type: ignore[attr-defined]
        pc.commit(0, pc.push({"w": torch.full((2, 3), 0.0)}, 0))
        assert worker.staleflow_pull(f"{host}:{port}", 0) == 0
        pc.commit(1, pc.push({"w": torch.full((2, 3), 1.0)}, 1))
        pc.push({"w": torch.full((2, 3), 2.0)}, 2)  # provisional: not served without its checksum
        assert worker.staleflow_pull(f"{host}:{port}", 2) == 1  # not committed: the latest committed
        assert [float(sd["w"][0, 0]) for sd in got] == [0.0, 1.0] and isinstance(got[0]["w"], torch.Tensor)
    finally:
        ps.stop()


@needs_vllm
def test_tensors_do_not_survive_vllms_rpc_serialisation_but_bytes_do():
    """Why the workers pull: collective_rpc's msgpack decodes a tensor argument untyped."""
    import torch
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    (named,) = MsgpackDecoder().decode(MsgpackEncoder().encode(([("w", torch.ones(2, 3))],)))
    assert not isinstance(named[0][1], torch.Tensor)
    assert MsgpackDecoder().decode(MsgpackEncoder().encode((b"\x00\x01",))) == [b"\x00\x01"]


@needs_vllm
def test_engine_args_ask_for_processed_logprobs_and_our_worker_extension(monkeypatch):
    import vllm

    seen: dict = {}  # the engine's arguments, captured before vLLM would build an engine
    monkeypatch.setattr(vllm, "AsyncEngineArgs", lambda **kw: seen.update(kw) or kw)
    monkeypatch.setattr(VLLMEngine, "_start", lambda self, *a, **kw: None)
    VLLMEngine("some/model", max_num_seqs=4)
    assert seen["logprobs_mode"] == "processed_logprobs"
    assert seen["worker_extension_cls"] == "workers.rollout.engines.vllm_engine.StaleFlowWorkerExtension"
    from vllm.engine.arg_utils import AsyncEngineArgs  # the real class takes these arguments

    assert AsyncEngineArgs(**seen).logprobs_mode == "processed_logprobs"


@needs_vllm
def test_engine_config_and_flags_reach_vllms_engine_args_exactly(tmp_path):
    """What `rollout-worker --engine vllm --engine-config FILE --engine-arg ...` builds: vLLM's
    real AsyncEngineArgs (no engine started) differs from its defaults in exactly the fields
    the file and the flags set, plus our worker extension and log-probs mode."""
    import dataclasses

    from vllm import AsyncEngineArgs

    from workers.rollout.engines import engine_config as ec
    from workers.rollout.engines.vllm_engine import EXTENSION, engine_args

    f = tmp_path / "engine.toml"
    f.write_text(
        'tensor_parallel_size = 2\ndtype = "bfloat16"\ngpu_memory_utilization = 0.7\n'
        "max_model_len = 2048\nenforce_eager = false\n"
    )
    cfg = ec.check_vllm(ec.engine_config(f, ["gpu_memory_utilization=0.5", "enforce_eager=true", "seed=7"]))
    args = engine_args("some/model", **ec.vllm_kwargs(cfg, 64))
    assert isinstance(args, AsyncEngineArgs)
    want = {
        "tensor_parallel_size": 2,
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
        "max_model_len": 2048,
        "enforce_eager": True,
        "seed": 7,
        "max_num_seqs": 64,
        "worker_extension_cls": EXTENSION,
        "logprobs_mode": "processed_logprobs",
    }
    assert {k: getattr(args, k) for k in want} == want
    default, again = AsyncEngineArgs(model="some/model"), AsyncEngineArgs(model="some/model")
    # fields whose defaults compare equal between two default instances (no identity-only objects)
    comparable = [
        fl.name for fl in dataclasses.fields(AsyncEngineArgs) if getattr(default, fl.name) == getattr(again, fl.name)
    ]
    changed = {name for name in comparable if getattr(args, name) != getattr(default, name)}
    assert changed <= set(want), changed - set(want)
    # every field name vLLM has is accepted, any other is refused before an engine is built
    assert ec.vllm_fields() == {fl.name for fl in dataclasses.fields(AsyncEngineArgs)}
    assert ec.VLLM_ARGS <= ec.vllm_fields()  # the allow-list used without vLLM names real fields
    with pytest.raises(ec.EngineConfigError, match="unknown vllm engine argument 'tensor_paralel_size'"):
        ec.check_vllm({"tensor_paralel_size": 2})


def test_every_vllm_finish_reason_maps_into_our_vocabulary():
    assert set(VLLM_FINISH_REASONS.values()) <= set(FINISH_REASONS)
    if HAVE_VLLM:  # and vLLM has no finish reason we do not map
        from vllm.v1.engine import FINISH_REASON_STRINGS

        assert set(FINISH_REASON_STRINGS) <= set(VLLM_FINISH_REASONS)


@needs_vllm
def test_kv_statistics_come_from_vllms_scheduler_stats():
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    eng, _ = engine("real")
    logger = eng._stat_logger()(vllm_config=None, engine_index=0)  # vLLM's factory call
    it = IterationStats()
    it.num_preempted_reqs = 2
    logger.record(
        scheduler_stats=SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25), iteration_stats=it
    )
    s = eng.stats()
    assert (s.running, s.waiting, s.kv_tokens, s.preemptions) == (3, 1, 32, 2)
    assert (eng.capacity().max_running, eng.capacity().kv_capacity) == (3, 8 * 16)


@needs_vllm
def test_capacity_comes_from_vllms_scheduler_cache_and_parallel_configs():
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig

    assert {"scheduler_config", "cache_config", "parallel_config"} <= set(VllmConfig.__dataclass_fields__)
    eng, fake = engine("real")
    cache = CacheConfig(block_size=16)
    cache.num_gpu_blocks = 8 * 2  # set by vLLM after profiling, summed over data-parallel engines
    fake.vllm_config = SimpleNamespace(
        model_config=fake.vllm_config.model_config,
        cache_config=cache,
        scheduler_config=SchedulerConfig(max_num_seqs=5, max_model_len=64, is_encoder_decoder=False),
        parallel_config=ParallelConfig(data_parallel_size=2),
    )
    cap = eng.capacity()
    assert (cap.max_running, cap.kv_capacity) == (5 * 2, 16 * 16)
