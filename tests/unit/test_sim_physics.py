"""The simulator's physical costs: PS egress shared by simultaneous pulls, the
trainer's wait while it sends weights, causal attention in prefill. Expected values are worked
out by hand from the set-up's numbers, not taken from the code under test."""

import pytest

from workers.coordinator.cost_model import get_cost_model
from workers.sim.engine import SampleTable, SimInstance
from workers.sim.ps import PSEgress
from workers.sim.setups import LEGACY_PHYSICS, get_setup
from workers.sim.simulator import Simulator

COST = get_cost_model("qwen_7b", "TP1_PP1")


def test_pulls_started_together_share_the_ps_and_finish_together():
    ps = PSEgress(streams=8, transfer_s=3.0, reload_s=1.0)
    # 20 pulls need ceil(20 / 8) = 3 rounds of 3 s on 8 streams; all load together
    assert ps.pull_durations(10.0, 20) == pytest.approx(3 * 3.0 + 1.0)
    # now 4 streams are free from 16 s and 4 busy until 19: a lone pull at 17 s goes at once
    assert ps.pull_durations(17.0, 1) == pytest.approx(3.0 + 1.0)
    # 8 more at 17 s: 3 free streams (17-20), then the 4 freed at 19 (19-22), then one of those
    # freed at 20 (20-23): loaded at 23 + 1
    assert ps.pull_durations(17.0, 8) == pytest.approx(23.0 - 17.0 + 1.0)


def test_a_lone_pull_or_an_unlimited_ps_is_one_transfer():
    assert PSEgress(streams=8, transfer_s=3.0, reload_s=1.0).pull_durations(0.0, 1) == pytest.approx(4.0)
    assert PSEgress(streams=None, transfer_s=3.0, reload_s=1.0).pull_durations(0.0, 500) == pytest.approx(4.0)


def test_set_up_numbers_follow_the_cited_bandwidths():
    su = get_setup("qwen_14b")
    # 14.8e9 params in bf16 over one 8.25 GB/s NIC, then 1 s of reload
    assert su.pull_time == pytest.approx(2 * 14.8e9 / 8.25e9 + 1.0)
    assert su.ps_streams == 8  # the PS's 8 NICs, one per TP1 pull
    assert get_setup("qwen_32b").ps_streams == 4  # a TP2 instance takes two NICs' worth
    assert su.push_time == pytest.approx(2 * 14.8e9 / 8.25e9)
    # Qwen2.5-14B: 48 layers, 40 heads of 128; 2 * 14.8e9 FLOPs per token of weights
    assert su.attn_coef == pytest.approx(48 * 40 * 128 / (2 * 14.8e9))
    assert get_setup("qwen_14b", **LEGACY_PHYSICS).attn_coef == 0.0


def test_prefill_pays_causal_attention_on_the_context():
    coef = 1e-4
    e = SimInstance(1, COST, 100_000, 8, 1_000.0, SampleTable(), attn_coef=coef)
    e.table.add(1, 1, 2_000, 10)
    e.add(1, 0.0)
    e.advance(0.0)
    # 2,000 tokens + 1e-4 * 2,000^2 = 2,400 token-equivalents at 1,000 per second
    assert e.stall_until == pytest.approx(2.4)


def _pull_seconds(setup, steps=2) -> tuple[float, int]:
    sim = Simulator(setup, "strict", 1, 0)
    sim.run(steps)
    return sum(e.pull_total for e in sim.engines.values()), sim.commands["pull"]


def test_strict_pulls_everyone_at_once_and_waits_for_the_ps():
    base = get_setup("small", **LEGACY_PHYSICS)
    free, n_free = _pull_seconds(base.scaled(nic_bandwidth=8.25e9))
    shared, n_shared = _pull_seconds(base.scaled(nic_bandwidth=8.25e9, ps_egress=8.25e9))  # one stream
    assert n_free == n_shared > 0
    # with one stream, 8 instances pulling together wait for all 8 transfers: far more pull time
    assert shared > 3 * free


def test_the_trainer_publishes_after_sending_its_weights():
    def first_publish(**changes) -> float:
        sim = Simulator(get_setup("tiny", **LEGACY_PHYSICS).scaled(**changes), "staleflow", 1, 0)
        sim.run(1)
        return sim.trainer.publish_times[0]

    # nothing before the first publish depends on the push: it moves that publish by its time
    pushed = get_setup("tiny", **LEGACY_PHYSICS).scaled(push_bandwidth=1e9)
    assert pushed.push_time == pytest.approx(2 * 7.6e9 / 1e9)
    assert first_publish(push_bandwidth=1e9) == pytest.approx(first_publish() + pushed.push_time, abs=0.2)
