"""Multi-turn (agentic) trajectories in the simulator and the coordinator: the workload's turn
and environment-latency statistics, environment wait kept apart from decode time in the engine
and the cost model, and the staleness bound per trajectory across its turns."""

import numpy as np
import pytest

from workers.coordinator.cost_model import get_cost_model
from workers.coordinator.policies import get_policy
from workers.coordinator.state import InstanceSnapshot, InstanceView, QueuedSample, RunningSample, SpeculativeState
from workers.coordinator.strategies import finishing_oldest, migrate_throughput_ratio
from workers.sim.engine import SampleTable, SimInstance
from workers.sim.setups import SETUPS, SHAPE_SETUPS
from workers.sim.simulator import Simulator
from workers.sim.workload import Workload, WorkloadShape
from workers.wire.enums import GroupState, SampleState

COST = get_cost_model("qwen_7b", "TP1_PP1")
AGENTIC = SETUPS["agentic"]


def test_agentic_shape_turns_and_environment_latency():
    assert "agentic" in SHAPE_SETUPS
    w = Workload(AGENTIC.workload, 0)
    st = w.stats(groups=1500, n=8)
    assert st["turns_mean"] == pytest.approx(3.98, abs=0.1)  # min(8, 1 + Poisson(3))
    assert st["turn_tokens_median"] == pytest.approx(300, rel=0.1)  # short answers per turn
    assert st["env_median"] == pytest.approx(1.5, rel=0.1)
    assert st["env_p99"] > 10 * st["env_median"]  # a long tail of slow tools
    assert st["env_mean"] > 1.5 * st["env_median"]
    draws = [w.group(k, 8) for k in range(300)]
    turns = np.concatenate([d.turns for d in draws])
    env = np.concatenate([d.env for d in draws])
    count = (turns > 0).sum(axis=1)
    assert count.min() == 1 and count.max() == 8 and (count >= 2).mean() > 0.8
    assert turns.max() <= AGENTIC.max_response and env.max() <= AGENTIC.workload.env_timeout
    for d in draws[:20]:
        for j in range(8):
            plan = d.plan(j)
            assert plan is not None
            toks, obs, lat = plan
            # an observation and an environment wait after every turn but the last
            assert len(obs) == len(lat) == len(toks) - 1 and sum(toks) == d.lengths[j]
            assert all(o >= 1 for o in obs) and all(t > 0 for t in lat)


def test_single_turn_shapes_draw_what_they_drew():
    shape = WorkloadShape()
    d = Workload(shape, 5).group(10, 16)
    assert d.turns is None and d.plan(0) is None
    # the multi-turn draws come after the single-turn ones: turn 1 is the single-turn length
    multi = Workload(WorkloadShape(max_turns=4, mean_turns=2.0, obs_median=50, env_median=1.0), 5).group(10, 16)
    assert multi.prompt_len == d.prompt_len and np.array_equal(multi.turns[:, 0], d.lengths)


def _multi_turn_engine(env_s=100.0, prefill=1_000.0):
    tbl = SampleTable()
    e = SimInstance(1, COST, 100_000, 256, prefill, tbl, attn_coef=1e-4)
    tbl.add(1, 1, 100, 10, ((10, 20), (5,), (env_s,)))  # turn of 10 tokens, 5-token answer after env_s, turn of 20
    e.add(1, 0.0)
    return e, tbl


def test_environment_wait_is_not_decode_time():
    e, tbl = _multi_turn_engine()
    e.advance(50.0)  # turn 1 is done; the environment has not answered yet
    assert e.finished == [] and e.env == {1: pytest.approx(tbl.turn_end[1] + 100.0)}
    snap = e.snapshot(50.0)
    # between turns the trajectory holds no decode slot and no KV the batch counts
    assert snap.running == 0 and snap.waiting == 0 and snap.kv_used == 0 and snap.env_waiting == 1
    (r,) = snap.running_samples
    assert r.in_env and r.env_since == pytest.approx(tbl.turn_end[1]) and r.tokens == 10 and r.length == 110
    e.advance(1e4)
    assert e.finished == [1] and tbl.gen[1] == 30 and tbl.prompt[1] == 105 and tbl.env_wait[1] == 100.0
    decode = sum(COST.latency(1, 100 + j) for j in range(10)) + sum(COST.latency(1, 115 + j) for j in range(20))
    prefill_1 = (100 + 1e-4 * 100**2) / 1_000.0
    prefill_2 = ((115 + 1e-4 * 115**2) - (110 + 1e-4 * 110**2)) / 1_000.0  # the observation over a cached context
    assert e.tokens == 30
    assert e.busy == pytest.approx(decode + prefill_1 + prefill_2)  # the 100 s of environment are not in it
    assert e.idle == pytest.approx(1e4 - e.busy)


def test_a_pull_between_turns_drops_the_prefix_cache():
    e, tbl = _multi_turn_engine(env_s=10.0)
    e.advance(5.0)
    assert e.env and e.start_pull(5.0, 1, 2.0) == [1] and not e.env  # off the engine, env call goes on
    e.advance(7.0)
    tbl.env_answer(1)  # the simulator queues it once the environment answers
    tbl.seg0[1] = tbl.gen[1]
    e.add(1, 16.0)
    before = e.prefill_tokens
    e.advance(1e4)
    assert e.finished == [1]
    assert e.prefill_tokens - before == pytest.approx(115 + 1e-4 * 115**2)  # the whole context again


def _view(iid, samples, running, kv, version=0, env_waiting=0):
    return InstanceView(iid, version, running, 0, kv, 200_000, tuple(samples), max_running=256, env_waiting=env_waiting)


def test_cost_model_keeps_environment_latency_apart_from_decode():
    rem = COST.remaining(8, 10_000, 100, env_s=30.0)
    assert rem.decode_s == pytest.approx(100 * COST.latency(8, 10_000)) and rem.env_s == 30.0
    assert rem.total == pytest.approx(rem.decode_s + 30.0)


def test_finishing_oldest_counts_decode_time_of_the_current_turn_only():
    # instance 1: its oldest trajectory decodes its current turn (1,900 of 2,000 tokens done)
    # after 20,000 tokens in earlier turns; instance 2: its oldest waits for its environment
    decoding = RunningSample(1, 21_900, 25_000, 0, turn_tokens=1_900)
    waiting = RunningSample(2, 500, 900, 0, turn_tokens=500, env_since=3.0)
    a = _view(1, [decoding], 1, 25_000)
    b = _view(2, [waiting, RunningSample(3, 10, 300, 1)], 1, 300, env_waiting=1)
    keep = finishing_oldest([a, b], COST, 2_000, horizon=30.0)
    assert keep == {1}  # 100 tokens left in its turn; instance 2's oldest holds no slot


def test_migration_never_moves_a_trajectory_between_turns():
    busy = [RunningSample(i, 5_000 - i, 6_000, 0) for i in range(1, 41)]
    env = [RunningSample(100 + i, 9_000, 10_000, 0, turn_tokens=300, env_since=1.0) for i in range(40)]
    loaded = _view(1, env + busy, 40, 40 * 6_000, env_waiting=40)
    starved = _view(2, [], 0, 0)
    (it,) = migrate_throughput_ratio([loaded, starved], {}, COST, psi=2.0, min_gain=0.0)
    assert it.instance_id == 1 and it.sample_ids and all(s < 100 for s in it.sample_ids)


def test_interrupting_a_trajectory_between_turns_frees_no_decode_slot():
    spec = SpeculativeState()
    env = RunningSample(7, 100, 400, 0, turn_tokens=100, env_since=1.0)
    run = RunningSample(8, 50, 300, 0)
    spec.observe(InstanceSnapshot(1, 0, 1, 0, 300, 10_000, (run, env), env_waiting=1, snapshot_at=1.0, max_running=256))
    spec.on_interrupt(1, [7], 2.0)
    v = spec.view(1)
    assert v.running == 1 and v.kv_used == 300 and v.env_waiting == 0


AGENTIC_SMALL = AGENTIC.scaled(
    name="agentic_small", instances=4, batch_size=8, group_size=4, train_gpus=8, step_time_scale=0.05
)


@pytest.mark.parametrize("policy", ["staleflow", "strict", "sync"])
def test_staleness_bound_holds_per_trajectory_across_turns(policy):
    eta = 2
    sim = Simulator(AGENTIC_SMALL, policy, eta, seed=1, check_every_step=True)
    r = sim.run(8)
    assert r.completed and r.invariant_violations == [] and r.route_refusals == 0
    p, tbl = sim.p, sim.table
    multi = spanned = 0
    for g in p.groups.values():
        if g.state != GroupState.CONSUMED:
            continue
        b = g.buffer
        for sid in g.sample_ids:
            s = p.samples[sid]
            if s.state != SampleState.REWARDED:
                continue
            plan = tbl.plan[sid]
            assert plan is not None and tbl.turn[sid] == len(plan[0]) - 1  # every turn generated
            assert tbl.gen[sid] == sum(plan[0]) and tbl.env_wait[sid] == pytest.approx(sum(plan[2]))
            versions = [seg.version for seg in s.segments]
            # every turn's segment within [V_traj, b], and b - V_traj within η
            assert s.v_traj is not None and s.v_traj <= min(versions) and max(versions) <= b
            assert b - s.v_traj <= sim.eta
            multi += len(plan[0]) > 1
            spanned += len(set(versions)) > 1
    assert multi > 0
    if policy != "sync":
        assert spanned > 0  # some trajectories' turns ran on more than one version
        assert r.commands["between_turns"] > 0  # ... and some were taken off an instance between turns
    else:
        assert spanned == 0 and sim.eta == 0


def test_routing_sees_trajectories_between_turns_as_no_load():
    # instance 1 holds 200 trajectories waiting for their environments and decodes nothing;
    # instance 2 decodes 60 samples: the new work goes to instance 1, as to an idle instance
    env = [RunningSample(100 + i, 900, 1_500, 0, turn_tokens=300, env_since=1.0) for i in range(200)]
    waiting_only = _view(1, env, 0, 0, env_waiting=200)
    busy = _view(2, [RunningSample(i, 500, 900, 0) for i in range(1, 61)], 60, 60 * 900)
    plan = get_policy("staleflow").plan([waiting_only, busy], [QueuedSample(1_000, 50, 300)], COST, ps_version=0)
    assert [(r.sample_id, r.instance_id) for r in plan.routes] == [(1_000, 1)]
