"""The discrete-event simulator: engine clock, protocol invariants under every policy, ordering."""

import math

import pytest

from workers.coordinator.cost_model import get_cost_model
from workers.coordinator.policies import ABLATIONS, BASELINES
from workers.sim.engine import SampleTable, SimInstance
from workers.sim.setups import SETUPS, get_setup
from workers.sim.simulator import SimResult, simulate

COST = get_cost_model("qwen_7b", "TP1_PP1")


def engine(cap=100_000, phi=None, max_running=256, prefill=1e12):
    return SimInstance(1, COST, cap, max_running, prefill, SampleTable(), phi_wait=phi)


def add(e, sid, prompt, target):
    e.table.add(sid, sid, prompt, target)
    e.add(sid, e.t)


def test_engine_finishes_on_the_cost_model_clock():
    e = engine()
    add(e, 1, 100, 10)
    add(e, 2, 100, 30)
    e.advance(1e9)
    assert e.finished == [1, 2]
    # 10 iterations with two samples, then 20 with one; KV grows by one token per sample each
    expect = sum(COST.latency(2, 200 + 2 * j) for j in range(10)) + sum(COST.latency(1, 110 + j) for j in range(20))
    assert e.busy == pytest.approx(expect)
    assert e.tokens == 40 and e.table.gen[1] == 10 and e.table.gen[2] == 30
    assert e.idle == pytest.approx(1e9 - expect)


def test_engine_advances_in_pieces_like_in_one_go():
    a, b = engine(), engine()
    for e in (a, b):
        for sid in range(1, 6):
            add(e, sid, 50 * sid, 100 * sid)
    a.advance(100.0)
    t = 0.0
    while t < 100.0:
        t = min(100.0, t + 0.137)
        b.advance(t)
    assert a.finished == b.finished
    assert a.busy == pytest.approx(b.busy)
    assert a.table.gen == b.table.gen


def test_engine_interrupt_keeps_tokens_and_pull_reloads():
    e = engine()
    add(e, 1, 100, 1_000)
    t_half = COST.iterations_time(1, 100, 400)
    e.advance(t_half + 1e-9)
    assert e.interrupt([1], e.t) == [1]
    assert e.table.gen[1] == 400 and e.n == 0
    add(e, 2, 100, 1_000)
    e.advance(e.t + 0.5)
    got = e.start_pull(e.t, 3, 2.0)
    assert got == [2] and e.pulling
    e.advance(e.t + 1.0)
    assert e.pulling and e.version == 0
    e.advance(e.t + 1.5)
    assert not e.pulling and e.version == 3 and e.pulled


def test_engine_prefill_and_kv_preemption():
    e = engine(cap=1_000, max_running=10, prefill=1_000.0)
    for sid in (1, 2, 3):
        add(e, sid, 200, 500)
    e.advance(0.0)
    assert e.n == 3 and e.stall_until == pytest.approx(0.6)  # 600 prompt tokens at 1000 tok/s
    e.advance(5.0)
    assert e.preemptions >= 1 and e.kv <= e.cap
    # φ_wait: with a waiting queue longer than φ the preempted sample leaves the engine
    f = engine(cap=1_000, max_running=10, prefill=1e12, phi=0)
    for sid in (1, 2, 3):
        add(f, sid, 200, 500)
    f.advance(5.0)
    assert f.interrupted and all(f.table.instance[s] == 0 for s in f.interrupted)


def test_next_event_time_is_the_next_finish():
    e = engine()
    add(e, 1, 100, 10)
    add(e, 2, 100, 30)
    e.advance(0.0)
    t = e.next_event_time()
    assert t == pytest.approx(sum(COST.latency(2, 200 + 2 * j) for j in range(10)))
    e.advance(t)
    assert e.finished == [1]


POLICIES = BASELINES + ABLATIONS


@pytest.fixture(scope="module")
def tiny_runs() -> dict[str, SimResult]:
    return {p: simulate("tiny", p, eta=2, steps=8, seed=3, check_every_step=True) for p in POLICIES}


@pytest.mark.parametrize("policy", POLICIES)
def test_protocol_invariants_hold_under_every_policy(tiny_runs, policy):
    r = tiny_runs[policy]
    assert r.completed and r.steps == 8
    assert r.invariant_violations == []
    assert r.route_refusals == 0  # the coordinator's admission view agrees with the protocol
    assert r.trained_groups == 8 * SETUPS["tiny"].batch_size
    assert r.trained_samples == r.trained_groups * SETUPS["tiny"].group_size
    assert max(r.staleness_hist) <= r.eta and min(r.staleness_hist) >= 0
    assert max(r.sample_staleness_hist) <= r.eta
    assert 0 <= r.rollout_idle_fraction <= 1 and r.tokens_per_s > 0
    assert len(r.step_times) == 8 and all(t > 0 for t in r.step_times)


def test_sync_never_trains_on_stale_data(tiny_runs):
    r = tiny_runs["sync"]
    assert r.eta == 0 and set(r.staleness_hist) == {0} and set(r.sample_staleness_hist) == {0}
    assert tiny_runs["one_step"].eta == 1


def test_async_policies_use_their_staleness(tiny_runs):
    assert max(tiny_runs["staleflow"].staleness_hist) == 2
    assert max(tiny_runs["strict"].staleness_hist) == 2


def test_staleflow_beats_sync_on_a_small_setup():
    setup = get_setup("small", instances=6, batch_size=12)
    sync = simulate(setup, "sync", eta=2, steps=6, seed=1)
    flow = simulate(setup, "staleflow", eta=2, steps=6, seed=1)
    assert flow.invariant_violations == [] and sync.invariant_violations == []
    assert flow.tokens_per_s > 1.3 * sync.tokens_per_s
    assert flow.steady_tokens_per_s > 1.3 * sync.steady_tokens_per_s


def test_same_seed_same_result_and_workload_shared_across_policies():
    a = simulate("tiny", "staleflow", eta=1, steps=3, seed=9)
    b = simulate("tiny", "staleflow", eta=1, steps=3, seed=9)
    assert a.virtual_time == b.virtual_time and a.trained_tokens == b.trained_tokens
    assert a.staleness_hist == b.staleness_hist
    # sync trains the first B groups in order: the same data as any policy's first batch would hold
    s = simulate("tiny", "sync", eta=1, steps=1, seed=9)
    assert s.trained_groups == SETUPS["tiny"].batch_size


def test_result_fields_are_consistent():
    r = simulate("tiny", "staleflow", eta=1, steps=4, seed=0)
    assert r.ratio_to_ideal == pytest.approx(r.steady_tokens_per_s / r.ideal_tokens_per_s)
    assert r.virtual_time == pytest.approx(sum(r.step_times))
    assert math.isclose(r.tokens_per_s, r.trained_tokens / r.virtual_time)
    assert r.generated_tokens >= r.trained_tokens
    d = r.to_dict()
    assert d["mean_staleness"] == r.mean_staleness and "staleness" in r.summary()


def test_switching_migration_off_changes_nothing_but_migration():
    """An ablation must differ in its one ingredient: without migration the keep-oldest pull rule
    still reads which running samples are about to finish (snapshots keep per-sample details),
    so the run equals one whose migrations can never pass their gain test."""
    from workers.coordinator.policies import get_policy

    setup = get_setup("small", instances=6, batch_size=12, max_response=2_000)
    off = simulate(setup, get_policy("staleflow", migration=False), eta=1, steps=6, seed=1)
    never = simulate(setup, get_policy("staleflow", migrate_min_gain=1e9), eta=1, steps=6, seed=1)
    assert off.commands.get("migration", 0) == never.commands.get("migration", 0) == 0
    assert (off.virtual_time, off.trained_tokens, off.prefill_tokens) == (
        never.virtual_time,
        never.trained_tokens,
        never.prefill_tokens,
    )
