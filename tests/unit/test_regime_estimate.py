"""The regime estimate (workers/coordinator/regime.py): labels per observation, and a stable
estimate over time (hysteresis)."""

import random

import pytest

from workers.coordinator.regime import REGIMES, RegimeEstimate, Signals, classify, observe
from workers.coordinator.state import InstanceView


def sig(**kw):
    base = dict(ready_buffer=False, budget_free=True, kv_usage=0.3, engine_waiting=0, decoding=500, budgeted=1000)
    base.update(kw)
    return Signals(**base)


def test_labels_name_the_binding_resource():
    assert classify(sig(ready_buffer=True)) == "trainer"
    assert classify(sig(engine_waiting=3)) == "kv"
    assert classify(sig(kv_usage=0.9)) == "kv"
    assert classify(sig(budget_free=False, decoding=800)) == "budget"
    assert classify(sig(budget_free=False, decoding=100)) == "straggler"
    assert classify(sig()) == "open"


def test_observe_reads_the_instances_not_pulling():
    views = [
        InstanceView(1, 0, 10, 2, 50_000, 100_000, max_running=256),
        InstanceView(2, 0, 0, 0, 0, 100_000, pulling=True, max_running=256),
    ]
    s = observe(views, ready_buffer=False, budget_free=False, budgeted=40)
    assert (s.kv_usage, s.engine_waiting, s.decoding, s.budgeted) == (0.5, 2, 10, 40)
    assert classify(s) == "kv"


def run(labels, dt=1.0, **kw):
    est, out = RegimeEstimate(), []
    for k, label in enumerate(labels):
        est = est.update(label, k * dt, **kw)
        out.append(est.regime)
    return est, out


@pytest.mark.parametrize("regime", REGIMES)
def test_a_fixed_regime_never_switches(regime):
    est, seen = run([regime] * 5_000)
    assert set(seen) == {regime} and est.switches == 0


def test_a_noisy_fixed_regime_does_not_oscillate():
    rng = random.Random(3)
    # 70% of the observations say straggler, the rest scatter over the other labels
    labels = [
        "straggler" if rng.random() < 0.7 else rng.choice(["open", "budget", "kv", "trainer"]) for _ in range(20_000)
    ]
    est, seen = run(labels)
    assert est.regime == "straggler" and est.switches == 0


def test_a_mixed_pair_of_regimes_switches_rarely():
    rng = random.Random(5)
    labels = ["budget" if rng.random() < 0.55 else "straggler" for _ in range(20_000)]
    est, _ = run(labels)
    assert est.switches <= 2  # the margin absorbs a near tie


def test_a_clear_change_switches_within_a_bounded_time():
    est, seen = run(["budget"] * 1_000 + ["trainer"] * 1_000, tau=120.0, margin=0.2, min_dwell=60.0)
    assert est.regime == "trainer" and est.switches == 1
    switched_at = seen.index("trainer")
    # the averages cross with a margin of 0.2 after tau * ln(1 / 0.4) ≈ 110 s
    assert 1_000 < switched_at < 1_000 + 150


def test_unknown_labels_are_refused():
    with pytest.raises(ValueError, match="not in"):
        RegimeEstimate().update("nonsense", 0.0)


# ---- the estimate inside the cycle -----------------------------------------------------------


def _admission(*counts, version=0):
    """Buffers 0, 1, ... with (occupied, reserved, consumed); B = 2 groups, η = 1."""
    from staleflow_db.rules import BufferCounts
    from staleflow_db.types import RunConfig
    from workers.coordinator.admission import AdmissionView

    cfg = RunConfig(batch_size=2, group_size=2, eta=1)
    bufs = {b: BufferCounts(b, *c) for b, c in enumerate(counts)}
    return AdmissionView(bufs, version, cfg, reserved={})


def test_the_admission_view_tells_the_budget_and_the_next_buffer():
    assert _admission((2, 0, False)).next_buffer_ready()
    assert _admission((2, 0, False)).can_reserve(0)  # buffer 1 (within version 0 + η) has room
    assert not _admission((2, 0, False), (0, 2, False)).can_reserve(0)  # both buffers taken
    assert not _admission((0, 1, False)).next_buffer_ready()
    # while buffer 0 trains (consumed), the trainer's next is buffer 1
    assert _admission((2, 0, True), (2, 0, False), version=0).next_buffer_ready()
    assert not _admission((2, 0, True), (1, 1, False), version=0).next_buffer_ready()


def test_each_cycle_with_a_clock_updates_the_speculative_states_estimate():
    from workers.coordinator.cost_model import get_cost_model
    from workers.coordinator.cycle import Applied, run_cycle
    from workers.coordinator.policies import get_policy
    from workers.coordinator.state import InstanceSnapshot, SpeculativeState

    st = SpeculativeState()
    st.observe(InstanceSnapshot(1, 0, 0, 0, 0, 100_000, max_running=64))
    adm = _admission((2, 0, False))  # a full buffer waits for the trainer
    for t in range(3):
        run_cycle(
            get_policy("staleflow"),
            get_cost_model("qwen_7b", "TP1_PP1"),
            st,
            [],
            lambda plan: Applied([], [], at=float(t)),
            ps_version=0,
            admission=adm,
            group_versions={},
            now=float(t),
        )
    assert st.regime_label == "trainer" and st.regime.regime == "trainer" and st.regime.at == 2.0


def test_phases_within_a_step_are_not_regime_changes():
    # 200-s steps, each half trainer-bound, half waiting for the rollout's tail
    labels = ["trainer" if t % 200 < 100 else "straggler" for t in range(40 * 200)]
    est = RegimeEstimate()
    for t, label in enumerate(labels):
        est = est.update(label, float(t), version=t // 200)
    assert est.switches == 0 and est.step_s == pytest.approx(200.0)
    # without the steps, the 120-s average follows the phases: it switches twice a step
    est, _ = run(labels)
    assert est.switches > 70
