"""The coordinator's routing at scale is a pure speed-up: the same decisions as before.

* Golden digests: every plan (routes, pulls, interrupts) of short simulations, hashed; the
  digests were recorded with the routing code before it was made incremental.
* `route_waterfall` against a one-sample-at-a-time reference, written from its docstring, on
  random small states (Hypothesis), with the admission oracles the coordinator uses.
"""

from __future__ import annotations

import hashlib
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow_db.rules import BufferCounts
from workers.coordinator import routing
from workers.coordinator.admission import AdmissionView, AlwaysAdmit, CallbackAdmission
from workers.coordinator.cost_model import CostModel, get_cost_model
from workers.coordinator.cycle import CycleOutcome
from workers.coordinator.policies import Policy, get_policy
from workers.coordinator.routing import NEW_LEVEL, RouteDecision, queue_levels, route_waterfall
from workers.coordinator.state import InstanceView, QueuedSample, RunningSample
from workers.coordinator.strategies import InterruptDecision, _best_move, migrate_throughput_ratio
from workers.sim.setups import LEGACY_PHYSICS, get_setup
from workers.sim.simulator import Simulator
from workers.wire.run_config import RunConfig

# Plan digests recorded with the one-by-one routing (commit e284257's route_waterfall);
# small/staleflow/2 with `pull_for_new_work` on (status-based pulls keep busy instances while no work
# waits for the new version); with the rule off it gives eac91486.... They fix the simplest
# physics (LEGACY_PHYSICS: pull and prefill times change what a correct coordinator decides),
# with `keep_oldest` off and a 5% migration gain, so they test the routing code alone.
GOLDEN = {
    ("small", "staleflow", 2): "bf057f8c46e7bb45f9128278706ac2e18fbc8f36da35dabca9d577ee1ffb1dcd",
    ("small", "staleflow-greedy-pull", 1): "23d1e937cb6493210a75185c63bde5ee4683efb95f740ec53f319688c683e19c",
    ("tiny", "staleflow", 1): "69d61ed98a365eb52086c3cfc1ff41bc6f5f6570d014855f1291d9d11611018b",
}


def _digest(setup: str, policy: str | Policy, eta: int, steps: int = 3) -> str:
    h = hashlib.sha256()

    def on_cycle(out: CycleOutcome, *_: float) -> None:
        p = out.plan
        h.update(repr(([(r.sample_id, r.instance_id) for r in p.routes], p.pulls, p.interrupts)).encode())

    Simulator(get_setup(setup, **LEGACY_PHYSICS), policy, eta, on_cycle=on_cycle).run(steps)
    return h.hexdigest()


@pytest.mark.parametrize("setup,policy,eta", sorted(GOLDEN))
def test_simulated_decisions_are_unchanged(setup, policy, eta):
    assert (
        _digest(setup, get_policy(policy, keep_oldest=False, migrate_min_gain=0.05), eta)
        == GOLDEN[(setup, policy, eta)]
    )


def test_decisions_with_the_pull_rule_off_are_the_ones_recorded_before_it():
    policy = get_policy("staleflow", pull_for_new_work=False, keep_oldest=False, migrate_min_gain=0.05)
    assert _digest("small", policy, 2) == "eac91486f0ecd65e86bb6a3405e92c15d4f43fca048051880ec2ddc922d16057"


# ---- reference waterfall -----------------------------------------------------------------------


def reference_waterfall(instances, queued, cost: CostModel, admission, *, mu, group_versions, block_scope):
    """route_waterfall's docstring, one sample at a time, in plain Python (numpy only for the
    throughput formula, so that gains round exactly as the optimised code's do)."""
    ids = [i.instance_id for i in instances]
    n = [float(i.running) for i in instances]
    kv = [float(i.kv_used) for i in instances]
    ver = [i.version for i in instances]
    versions = sorted(set(ver))
    blocked = [False] * len(instances)
    T = list(cost.throughput_array(np.array(n), np.array(kv)))
    keyed = hasattr(admission, "key")
    routes = []
    for level, samples in queue_levels(queued, group_versions):

        def base(j):
            i = instances[j]
            return not i.pulling and not blocked[j] and i.waiting == 0 and n[j] < i.max_running

        if not any(base(j) for j in range(len(ids))):
            break
        if level == NEW_LEVEL and not any(admission.admits(samples[0], v) for v in versions):
            break
        # outside the newest level, a keyed oracle's answers are taken once, at the level's start
        fixed = None
        if keyed and level != NEW_LEVEL:
            fixed = {}
            for s in samples:
                k = admission.key(s)
                if k not in fixed:
                    fixed[k] = {v: admission.admits(s, v) for v in versions}
            keys = {s.sample_id: admission.key(s) for s in samples}
        failed_need = None
        for s in samples:
            L = float(s.length)
            thresh = mu * float(cost.throughput_array(np.ones(1), np.array([L]))[0])
            best, best_j = -np.inf, None
            for j in range(len(ids)):
                if not base(j) or ver[j] < s.min_instance_version or kv[j] + L > instances[j].kv_capacity:
                    continue
                if fixed is not None:
                    ok = fixed[keys[s.sample_id]][ver[j]]
                else:
                    ok = admission.admits(s, ver[j])
                if not ok:
                    continue
                n1 = np.array([n[j] + 1])
                g = float((n1 / cost.latency_array(n1, np.array([kv[j] + L])) - T[j])[0])
                if g >= thresh:  # eligible; the largest gain wins
                    if g > best:
                        best, best_j = g, j
            if best_j is None:
                need = s.min_instance_version
                failed_need = need if failed_need is None else min(failed_need, need)
                continue
            j = best_j
            admission.commit(s, ver[j])
            routes.append(RouteDecision(s.sample_id, ids[j]))
            n[j] += 1
            kv[j] += L
            T[j] = cost.throughput(n[j], kv[j])
        if failed_need is not None:
            if block_scope == "all":
                break
            blocked = [b or ver[j] >= failed_need for j, b in enumerate(blocked)]
            if all(blocked):
                break
    return routes


# ---- random small states -----------------------------------------------------------------------

COST = get_cost_model("qwen_7b", "TP1_PP1")
CAP = 4000


@st.composite
def instances_st(draw):
    out = []
    for k in range(draw(st.integers(1, 7))):
        max_running = draw(st.integers(1, 6))
        running = draw(st.integers(0, max_running))
        cap = draw(st.sampled_from([CAP, CAP // 2]))
        out.append(
            InstanceView(
                instance_id=10 + k,
                version=draw(st.integers(0, 2)),
                running=running,
                waiting=draw(st.sampled_from([0, 0, 0, 1])),
                kv_used=draw(st.integers(0, cap)) if running else 0,
                kv_capacity=cap,
                pulling=draw(st.booleans()) and draw(st.booleans()),
                max_running=max_running,
            )
        )
    return out


@st.composite
def queued_st(draw):
    """Fresh members of new groups, fresh members of in-flight groups, and partials with tokens;
    members of a group share its prompt length, as they do in the trajectory server."""
    out, group_versions = [], {}
    sid = 100
    for g in range(draw(st.integers(0, 8))):
        prompt = draw(st.sampled_from([50, 300, 1200, 2500]))
        in_flight = draw(st.booleans())
        if in_flight:
            group_versions[g] = draw(st.integers(0, 2))
        for _ in range(draw(st.integers(1, 5))):
            if in_flight and draw(st.booleans()):
                v = draw(st.integers(group_versions[g], 2))
                tokens = draw(st.integers(1, 1500))
                last = draw(st.one_of(st.none(), st.integers(v, 2)))
                out.append(QueuedSample(sid, g, prompt + tokens, v, tokens, last))
            else:
                out.append(QueuedSample(sid, g, prompt))
            sid += 1
    if draw(st.booleans()):  # the trajectory server's order is mostly by group; not always
        order = draw(st.permutations(range(len(out))))
        out = [out[k] for k in order]
    return out, group_versions


def _admission(kind: str, seed: int, group_versions):
    if kind == "always":
        return AlwaysAdmit()
    if kind == "callback":  # refuses some (sample, version) pairs, deterministically
        return CallbackAdmission(lambda s, v: (s.sample_id * 7 + v * 3 + seed) % 5 != 0)
    # the protocol's rules: small buffers, so that reservations run out within a cycle
    buffers = {b: BufferCounts(b, occupied=(seed + b) % 3, reserved=(seed * b) % 2) for b in range(1, 4)}
    return AdmissionView(
        buffers,
        1,
        RunConfig(batch_size=3, buffer_capacity=4, group_size=1, eta=1),
        {g: v + 1 for g, v in group_versions.items()},
    )


@settings(max_examples=400, deadline=None)
@given(
    instances_st(),
    queued_st(),
    st.sampled_from(["always", "callback", "view"]),
    st.integers(0, 9),
    st.sampled_from([0.0, 0.25, 0.6]),
    st.sampled_from(["instance", "all"]),
    st.sampled_from([1, 8, 1 << 16]),
)
def test_waterfall_equals_the_one_by_one_reference(instances, queued_gv, kind, seed, mu, block_scope, block):
    queued, group_versions = queued_gv
    kw = dict(mu=mu, group_versions=group_versions, block_scope=block_scope)
    saved, routing._BLOCK_ELEMENTS = routing._BLOCK_ELEMENTS, block  # small blocks: many of them
    try:
        got = route_waterfall(instances, queued, COST, _admission(kind, seed, group_versions), **kw)
    finally:
        routing._BLOCK_ELEMENTS = saved
    want = reference_waterfall(instances, queued, COST, _admission(kind, seed, group_versions), **kw)
    assert got == want


# ---- bounded work ------------------------------------------------------------------------------


class CountingAdmission(AlwaysAdmit):
    """Admits everything; counts how often the strategy asks (one question per sample per
    route would make a fresh batch's cycle quadratic in the batch)."""

    def __init__(self) -> None:
        self.keys = self.asks = 0

    def admits(self, sample: QueuedSample, instance_version: int) -> bool:
        self.asks += 1
        return True

    def key(self, sample: QueuedSample):
        self.keys += 1
        return ()


def test_a_fresh_batch_costs_a_few_questions_per_sample():
    # 320 empty instances, a fresh batch of 125 groups of 16: every sample is routed
    cost = get_cost_model("qwen_14b", "TP1_PP1")
    instances = [InstanceView(k, 0, 0, 0, 0, 268_554, max_running=256) for k in range(320)]
    queued = [QueuedSample(16 * g + k, g, 100 + g % 7 * 50) for g in range(125) for k in range(16)]
    adm = CountingAdmission()
    routes = route_waterfall(instances, queued, cost, adm)
    assert len(routes) == len(queued)
    assert adm.keys + adm.asks <= 4 * len(queued)


def test_the_benchmark_quick_mode_prints_its_summary():
    script = Path(__file__).resolve().parents[2] / "bench" / "coordinator.py"
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(
        r"coordinator instances=(\d+) in_flight=(\d+) p50_ms=([\d.]+) p99_ms=([\d.]+) max_ms=([\d.]+)", last
    )
    assert m, out.stdout[-3000:]
    assert int(m.group(1)) == 32 and int(m.group(2)) > 0
    assert float(m.group(3)) <= float(m.group(4)) <= float(m.group(5))


# ---- migration: the pair ranking -------------------------------------------------------------


def reference_migrate(instances, routable, cost, *, psi, min_running=2, min_gain=0.05, max_tries=8):
    """migrate_throughput_ratio as it was before its pairs became a numpy matrix."""
    live = [i for i in instances if not i.pulling]
    starved = [i for i in live if i.waiting == 0 and not routable.get(i.version, False)]
    if not starved:
        return []
    thr = lambda i: cost.throughput(i.running, i.kv_used)  # noqa: E731
    loaded = sorted(((thr(ld), ld) for ld in live if ld.running >= min_running), key=lambda x: -x[0])
    if not loaded:
        return []
    starved_t = sorted(((thr(s), s) for s in starved), key=lambda x: x[0])
    if loaded[0][0] <= psi * starved_t[0][0]:
        return []
    pairs = []
    for ts, s in starved_t:
        for tl, ld in loaded:
            if tl <= psi * ts:
                break
            if ld.instance_id == s.instance_id or ld.version > s.version or ld.running - s.running < 2:
                continue
            pairs.append((math.inf if ts <= 0 else tl / ts, tl, s, ld))
    pairs.sort(key=lambda x: (x[0], x[1]), reverse=True)
    for _, _, s, ld in pairs[:max_tries]:
        ids = _best_move(s, ld, cost, min_gain)
        if ids:
            return [InterruptDecision(ld.instance_id, ids, "migration")]
    return []


@st.composite
def loaded_instances_st(draw):
    out, sid = [], 1
    for k in range(draw(st.integers(1, 24))):
        running = draw(st.sampled_from([0, 0, 1, 2, 3, 6, 12, 12, 24]))  # repeats: tied throughputs
        rs = []
        for _ in range(running):
            tokens = draw(st.sampled_from([10, 500, 3000]))
            rs.append(RunningSample(sid, tokens, 100 + tokens, draw(st.integers(0, 1))))
            sid += 1
        out.append(
            InstanceView(
                k,
                draw(st.integers(0, 1)),
                running,
                draw(st.sampled_from([0, 0, 0, 1])),
                sum(r.length for r in rs),
                40_000,
                tuple(rs),
                pulling=draw(st.booleans()) and draw(st.booleans()),
                max_running=64,
            )
        )
    return out


@settings(max_examples=150, deadline=None)
@given(
    loaded_instances_st(),
    st.sampled_from([{}, {0: True}, {1: True}]),
    st.sampled_from([1.0, 2.0, 4.0]),
    st.sampled_from([0.0, 0.05]),
    st.sampled_from([1, 8]),
)
def test_migration_equals_the_pairwise_reference(instances, routable, psi, min_gain, max_tries):
    kw = dict(psi=psi, min_gain=min_gain, max_tries=max_tries)
    assert migrate_throughput_ratio(instances, routable, COST, **kw) == reference_migrate(
        instances, routable, COST, **kw
    )
