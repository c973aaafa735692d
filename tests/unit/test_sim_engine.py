"""The cost-model `sim` engine: lengths agree across instances, interrupt + continue keeps the
total, KV capacity forces preemption, and the clock follows the cost model."""

from __future__ import annotations

from workers.coordinator.cost_model import get_cost_model
from workers.rollout.engines.base import FinishedEvent, PreemptedEvent
from workers.rollout.engines.sim_engine import SimEngine, encode_prompt, target_length

COST = get_cost_model("qwen_7b", "TP1_PP1")


def _run(engine):
    out = {}
    while engine.has_work():
        for e in engine.step():
            if isinstance(e, FinishedEvent):
                out[e.sample_id] = e
    return out


def test_lengths_are_per_sample_deterministic_and_long_tailed():
    prompt = encode_prompt(64, group_median=200, member_sigma=1.0)
    lengths = [target_length(prompt, seed, 4000) for seed in range(2000)]
    assert lengths == [target_length(prompt, seed, 4000) for seed in range(2000)]
    lengths.sort()
    assert 150 < lengths[1000] < 260  # median near the group's
    assert lengths[-20] > 5 * lengths[1000]  # a long tail
    assert max(lengths) == 4000  # truncated at the maximum


def test_interrupt_and_continue_keep_the_total_length():
    prompt = encode_prompt(32, 300, 0.5)
    whole = _run(_engine(add=[("1", prompt, 7)]))["1"]
    a = _engine(add=[("1", prompt, 7)])
    for _ in range(3):
        a.step()
    (part,) = a.interrupt(["1"])
    assert 0 < len(part.tokens) < len(whole.tokens)
    b = SimEngine(COST, time_scale=0)
    b.add_request("1", prompt, part.tokens, part.logprobs, max_new_tokens=4096 - len(part.tokens), seed=7)
    rest = _run(b)["1"]
    assert len(part.tokens) + len(rest.tokens) == len(whole.tokens)
    assert rest.finish_reason == whole.finish_reason


def test_kv_capacity_preempts_and_everything_still_finishes():
    prompts = [(str(i), encode_prompt(100, 400, 0.3), i) for i in range(6)]
    e = _engine(add=prompts, kv_capacity_tokens=1500)
    finished, preempted = {}, 0
    while e.has_work():
        assert e.stats().kv_tokens <= 1500
        for ev in e.step():
            preempted += isinstance(ev, PreemptedEvent)
            if isinstance(ev, FinishedEvent):
                finished[ev.sample_id] = ev
    assert preempted > 0 and sorted(finished) == [str(i) for i in range(6)]


def test_simulated_time_follows_the_cost_model():
    e = _engine(add=[("1", encode_prompt(10, 50, 0.0), 1)])
    out = _run(e)["1"]
    n = len(out.tokens)
    assert abs(e.sim_time - COST.iterations_time(1, 11, n)) < 1e-3 * e.sim_time


def _engine(add, **kw):
    e = SimEngine(COST, time_scale=0, **kw)
    for sid, prompt, seed in add:
        e.add_request(sid, prompt, max_new_tokens=4096, seed=seed)
    return e
