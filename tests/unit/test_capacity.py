"""An engine's reported capacity in the coordinator: routing never gives an instance more
requests than its `max_running` nor more KV than its `kv_capacity`, cycle after cycle on the
speculative state; the service reads the capacity from the stored snapshot, and an instance
that reported none gets the documented conservative default."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from staleflow_db.protocol.coordination import InstanceView as InstanceRow
from staleflow_db.protocol.coordination import RunningSample as RunningRow
from staleflow_db.protocol.coordination import Snapshot
from staleflow_db.types import RunConfig
from workers.coordinator.admission import AlwaysAdmit
from workers.coordinator.cost_model import get_cost_model
from workers.coordinator.cycle import Applied, run_cycle
from workers.coordinator.policies import POLICY_NAMES, CyclePlan, get_policy
from workers.coordinator.routing import route_request_count, route_waterfall
from workers.coordinator.service import UNREPORTED_MAX_RUNNING, instance_snapshots
from workers.coordinator.state import InstanceSnapshot, QueuedSample, RunningSample, SpeculativeState
from workers.rollout.engines.sim_engine import SimEngine
from workers.wire.models import Capacity

COST = get_cost_model("qwen_7b", "TP1_PP1")


def _spec(caps: dict[int, int], kv: int = 1_000_000) -> SpeculativeState:
    st = SpeculativeState()
    for iid, cap in caps.items():
        st.observe(InstanceSnapshot(iid, 0, 0, 0, 0, kv, max_running=cap))
    return st


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_policy_routes_an_instance_beyond_its_cap(name):
    # a long queue, no snapshot between cycles: only the speculative state knows the load
    st = _spec({1: 2, 2: 5, 3: 1})
    queued = [QueuedSample(100 + k, 1 + k // 2, 200) for k in range(200)]
    routed: dict[int, int] = {}

    def apply(plan: CyclePlan) -> Applied:
        for r in plan.routes:
            routed[r.instance_id] = routed.get(r.instance_id, 0) + 1
        return Applied([True] * len(plan.routes), [], at=0.0)

    for _ in range(5):
        out = run_cycle(
            get_policy(name), COST, st, queued, apply, ps_version=0, admission=AlwaysAdmit(), group_versions={}
        )
        sent = {r.sample_id for r in out.plan.routes}
        queued = [q for q in queued if q.sample_id not in sent]
    assert routed and all(routed[i] <= cap for i, cap in {1: 2, 2: 5, 3: 1}.items()), routed
    assert all(v.requests <= v.max_running for v in st.views())


def test_request_count_routing_fills_each_instance_to_its_cap():
    views = _spec({1: 2, 2: 3}).views()
    queued = [QueuedSample(k, k, 100) for k in range(10)]
    routes = route_request_count(views, queued)
    assert sorted(r.instance_id for r in routes) == [1, 1, 2, 2, 2]


def test_waterfall_keeps_within_the_kv_capacity():
    # 1_000 KV tokens, samples of 300: three fit, the fourth would not, whatever the slots
    views = _spec({1: 100}, kv=1_000).views()
    queued = [QueuedSample(k, k, 300) for k in range(6)]
    routes = route_waterfall(views, queued, COST, mu=0.0)
    assert [r.sample_id for r in routes] == [0, 1, 2]
    # a sample longer than the whole cache goes nowhere
    assert route_waterfall(views, [QueuedSample(9, 9, 1_001)], COST, mu=0.0) == []


def _snapshot(instances: list[InstanceRow]) -> Snapshot:
    cfg = RunConfig(batch_size=1, group_size=1, eta=0, max_prompt_tokens=100, max_response_tokens=400)
    return Snapshot(1, 0, cfg, {}, instances, [])


def test_the_service_reads_the_reported_capacity_and_defaults_the_unreported(caplog):
    reported = InstanceRow(1, "a", 0, {"capacity": {"max_running": 7, "kv_capacity": 9_000}}, 0.1, [])
    silent = InstanceRow(2, "b", 0, {"running": 0}, 0.1, [])
    unreported: set[int] = set()
    with caplog.at_level(logging.WARNING, "staleflow.coordinator"):
        a, b = instance_snapshots(_snapshot([reported, silent]), 10.0, unreported)
        instance_snapshots(_snapshot([reported, silent]), 11.0, unreported)
    assert (a.max_running, a.kv_capacity) == (7, 9_000)
    # one request at a time, with KV room for one longest sample (prompt + response budgets)
    assert (b.max_running, b.kv_capacity) == (UNREPORTED_MAX_RUNNING, 500) == (1, 500)
    assert unreported == {2}
    assert [r.getMessage() for r in caplog.records] == [
        "instance 2 (b) reported no capacity: routed 1 request at a time"
    ]


def test_samples_the_database_holds_running_count_even_before_the_engine_sees_them():
    # routed but not yet taken in (or finished but not yet reported): they occupy slots
    row = InstanceRow(
        1,
        "a",
        0,
        {"running": 0, "waiting": 0, "capacity": {"max_running": 2, "kv_capacity": 1_000}},
        0.1,
        [RunningRow(5, 0, 10, 0), RunningRow(6, 0, 10, 0)],
    )
    (snap,) = instance_snapshots(_snapshot([row]), 10.0)
    assert snap.requests == 2
    st = SpeculativeState()
    st.observe(snap)
    assert route_request_count(st.views(), [QueuedSample(9, 9, 10)]) == []


def test_trajectories_waiting_for_their_environment_hold_no_slot_in_the_service_view():
    """The heartbeat's multi-turn fields map onto RunningSample / InstanceSnapshot: a sample
    the database holds here that the heartbeat saw waiting for its environment is not counted
    against max_running (nor KV); its wait is on the coordinator's clock (snapshot time - wait)."""
    hb = {
        "running": 1,
        "waiting": 0,
        "kv_used": 40,
        "env_waiting": 1,
        "capacity": {"max_running": 2, "kv_capacity": 1_000},
        "running_samples": [
            {"sample_id": 5, "tokens": 30, "turn_tokens": 4, "env_waited_s": None},
            {"sample_id": 6, "tokens": 12, "turn_tokens": 2, "env_waited_s": 1.5},
            {"sample_id": 7, "tokens": 9, "turn_tokens": 9, "env_waited_s": 0.5},  # answered since: not held
        ],
    }
    row = InstanceRow(1, "a", 0, hb, 0.25, [RunningRow(5, 20, 10, 0), RunningRow(6, 12, 10, 0)])
    (snap,) = instance_snapshots(_snapshot([row]), 10.0)
    by_id = {r.sample_id: r for r in snap.running_samples}
    assert set(by_id) == {5, 6}
    assert by_id[5] == RunningSample(5, 30, 40, 0, turn_tokens=4, env_since=None)
    assert by_id[6] == RunningSample(6, 12, 22, 0, turn_tokens=2, env_since=10.0 - 0.25 - 1.5)
    assert (snap.running, snap.waiting, snap.env_waiting, snap.kv_used) == (1, 0, 1, 40)
    # one free slot: the trajectory between turns does not take it
    st = SpeculativeState()
    st.observe(snap)
    assert [r.sample_id for r in route_request_count(st.views(), [QueuedSample(9, 9, 10)])] == [9]
    # a heartbeat without the fields (single-turn worker): both held samples count
    row = InstanceRow(1, "a", 0, {**hb, "running": 0, "running_samples": []}, 0.25, list(row.running))
    (snap,) = instance_snapshots(_snapshot([row]), 10.0)
    assert (snap.running, snap.env_waiting) == (2, 0)
    assert all(r.turn_tokens is None and not r.in_env for r in snap.running_samples)


@pytest.mark.parametrize("field", ["max_running", "kv_capacity"])
@pytest.mark.parametrize("value", [0, -1])
def test_a_capacity_below_one_is_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError) as e:
        Capacity.model_validate({"max_running": 4, "kv_capacity": 100, field: value})
    assert e.value.errors()[0]["loc"] == (field,)


def test_the_sim_engine_and_the_simulator_report_the_batch_models_capacity():
    eng = SimEngine(COST, kv_capacity_tokens=5_000, max_running=3, time_scale=0)
    assert eng.capacity() == Capacity(max_running=3, kv_capacity=5_000)
    assert (eng.batch.max_running, eng.batch.cap) == (3, 5_000)  # the fields the simulator reports
