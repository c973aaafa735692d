"""The one batching/timing model (`timing.BatchModel`): the simulator's instances and the live
`sim` engine run it, admission keeps the KV watermark free, decode time is the cost model's,
and preemption follows the φ_wait rule of `strategies`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workers.coordinator.cost_model import default_path, get_cost_model
from workers.rollout.engines.base import FinishedEvent, PreemptedEvent
from workers.rollout.engines.sim_engine import SimEngine, encode_prompt, target_length
from workers.rollout.engines.timing import BatchModel
from workers.sim.engine import SampleTable, SimInstance

COST = get_cost_model("qwen_7b", "TP1_PP1")


def _hand_latency(n: int, kv: int) -> float:
    """SPEC §4's formula on the raw numbers of cost_models.json, not through CostModel."""
    c = json.loads(default_path().read_text())["qwen_7b"]["TP1_PP1"]
    return c["attn_b"] + c["attn_k"] * kv + max(c["other_threshold"], c["other_b"] + c["other_k"] * n)


class _Lens:
    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.gen: dict[int, int] = {}
        self.target: dict[int, int] = {}

    def add(self, sid: int, prompt: int, target: int, gen: int = 0) -> None:
        self.prompt[sid], self.target[sid], self.gen[sid] = prompt, target, gen


def test_both_engines_run_the_same_batch_model():
    inst = SimInstance(1, COST, 10_000, 8, 1e12, SampleTable())
    eng = SimEngine(COST, kv_capacity_tokens=10_000, max_running=8, time_scale=0)
    assert type(inst.batch) is BatchModel and type(eng.batch) is BatchModel
    assert inst.batch.watermark == eng.batch.watermark == max(10_000 // 100, 8 + 1)


def test_admission_keeps_the_kv_watermark_free():
    lens = _Lens()
    b = BatchModel(COST, 10_000, 8, lens)  # watermark: 100 tokens
    lens.add(1, 5_000, 10)
    lens.add(2, 4_900, 10)  # 9_900 = capacity - watermark: fits
    lens.add(3, 1, 10)  # one token over the watermark: waits
    b.waiting.extend([1, 2, 3])
    assert b.admit() == 9_900
    assert list(b.run) == [1, 2] and list(b.waiting) == [3] and b.kv == 9_900
    # an empty batch admits its first sample whatever its size (else it would wait forever)
    lens2 = _Lens()
    big = BatchModel(COST, 1_000, 8, lens2)
    lens2.add(1, 995, 10)
    big.waiting.append(1)
    assert big.admit() == 995 and big.n == 1
    # running slots bound admission too
    lens3 = _Lens()
    slots = BatchModel(COST, 100_000, 2, lens3)
    for sid in (1, 2, 3):
        lens3.add(sid, 10, 10)
        slots.waiting.append(sid)
    slots.admit()
    assert slots.n == 2


def test_the_sim_engine_admits_with_the_same_watermark():
    e = SimEngine(COST, kv_capacity_tokens=1_000, max_running=4, time_scale=0)  # watermark: 10
    e.add_request("1", encode_prompt(600, 50, 0.0), max_new_tokens=4096, seed=1)
    e.add_request("2", encode_prompt(391, 50, 0.0), max_new_tokens=4096, seed=2)  # 991 > 990
    e.step()
    assert e.stats().running == 1 and e.stats().waiting == 1


def test_latency_is_the_cost_model_formula():
    for n, kv in [(1, 0), (1, 5_000), (20, 40_000), (64, 150_000), (256, 400_000)]:
        assert COST.latency(n, kv) == pytest.approx(_hand_latency(n, kv), rel=1e-12)
    ns, kvs = np.array([1, 20, 256]), np.array([0, 40_000, 400_000])
    want = [_hand_latency(int(n), int(kv)) for n, kv in zip(ns, kvs)]
    assert COST.latency_array(ns, kvs) == pytest.approx(want, rel=1e-12)


def test_batch_time_is_the_sum_of_iteration_latencies():
    lens = _Lens()
    b = BatchModel(COST, 1_000_000, 256, lens)
    for sid in range(1, 21):
        lens.add(sid, 100 * sid, 1_000)
        b.waiting.append(sid)
    b.admit()
    n, kv = b.n, b.kv
    # each iteration adds one KV token per running sample
    assert b.time(50) == pytest.approx(sum(_hand_latency(n, kv + n * j) for j in range(50)), rel=1e-12)
    assert b.within(b.time(50)) == 50
    b.decode(50)
    assert b.kv == kv + 50 * n


def test_preemption_takes_the_latest_admitted_and_applies_phi_wait():
    lens = _Lens()
    b = BatchModel(COST, 1_000, 4, lens)  # watermark: 10
    for sid in (1, 2, 3):
        lens.add(sid, 300, 500)
        b.waiting.append(sid)
    b.admit()
    assert b.n == 3 and b.room() == (1_000 - 900) // 3
    b.decode(b.room())
    assert b.room() <= 0
    assert b.preempt(phi_wait=None) == (3, False)  # waits at the front, tokens kept
    assert list(b.waiting) == [3] and lens.gen[3] == 33
    # φ_wait = 1: a waiting queue of 2 (counting the preempted sample) exceeds it
    assert b.preempt(phi_wait=1) == (2, True)
    assert list(b.waiting) == [3] and b.preemptions == 2


def test_the_simulator_and_the_sim_engine_agree_on_a_batch():
    """Same samples, same capacity: same finish order and the same simulated time."""
    prompt = encode_prompt(200, 300, 0.8)
    seeds = range(1, 10)
    targets = {s: target_length(prompt, s, 4096) for s in seeds}
    inst = SimInstance(1, COST, 3_000, 8, 1e15, SampleTable())
    eng = SimEngine(COST, kv_capacity_tokens=3_000, max_running=8, time_scale=0, max_step_s=1e9, prefill_rate=0)
    for s in seeds:
        inst.table.add(s, s, len(prompt), targets[s])
        inst.add(s, 0.0)
        eng.add_request(str(s), prompt, max_new_tokens=4096, seed=s)
    inst.advance(1e9)
    order, preempted = [], 0
    while eng.has_work():
        for ev in eng.step():
            preempted += isinstance(ev, PreemptedEvent)
            if isinstance(ev, FinishedEvent):
                assert len(ev.tokens) == targets[int(ev.sample_id)]
                order.append(int(ev.sample_id))
    assert preempted == inst.preemptions > 0
    assert order == inst.finished
    assert eng.sim_time == pytest.approx(inst.busy, rel=1e-9)


def test_a_sample_alone_over_capacity_finishes_with_reason_capacity():
    e = SimEngine(COST, kv_capacity_tokens=300, max_running=4, time_scale=0, max_step_s=1e9)
    e.add_request("1", encode_prompt(250, 1_000, 0.0), max_new_tokens=4096, seed=1)
    out = [ev for _ in range(5) for ev in e.step() if isinstance(ev, FinishedEvent)]
    assert [(ev.finish_reason, len(ev.tokens)) for ev in out] == [("capacity", 50)]
    assert not e.has_work()
