import json

import numpy as np
import pytest

from workers.coordinator import cost_model as cm
from workers.coordinator.cost_model import CostModel, fit, get_cost_model, load_cost_models

KNOWN = CostModel(other_threshold=0.012303, other_b=0.0049075, other_k=0.0002441, attn_b=0.0019664, attn_k=1.165e-07)


def test_packaged_fits_load_and_match_json():
    models = load_cost_models()
    assert set(models) == {"qwen_7b", "qwen_14b", "qwen_32b", "qwen_moe_30b"}
    assert get_cost_model("qwen_14b") == KNOWN
    assert get_cost_model("qwen_7b", "TP2_PP1").other_k == pytest.approx(0.000085)
    raw = json.loads(cm.PACKAGED_PATH.read_text())
    assert raw["qwen_32b"]["TP2_PP1"]["attn_k"] == get_cost_model("qwen_32b").attn_k
    if cm.SHARED_PATH.exists():  # the packaged copy is the shared file
        assert json.loads(cm.SHARED_PATH.read_text()) == raw


def test_explicit_path_and_errors(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"_about": "x", "m": {"TP1": KNOWN.to_dict()}}))
    assert get_cost_model("m", path=p) == KNOWN
    with pytest.raises(KeyError):
        get_cost_model("nope", path=p)
    with pytest.raises(KeyError):
        get_cost_model("qwen_7b")  # two parallelisms: must name one


def test_latency_and_throughput_formula():
    n, kv = 40, 200_000
    lat = KNOWN.attn_b + KNOWN.attn_k * kv + max(KNOWN.other_threshold, KNOWN.other_b + KNOWN.other_k * n)
    assert KNOWN.latency(n, kv) == pytest.approx(lat)
    assert KNOWN.throughput(n, kv) == pytest.approx(n / lat)
    assert KNOWN.throughput(0, 0) == 0.0
    assert cm.latency(n, kv, KNOWN) == KNOWN.latency(n, kv)
    assert cm.throughput(n, kv, KNOWN) == KNOWN.T(n, kv)
    arr = KNOWN.throughput_array(np.array([0, 1, n]), np.array([0, 10, kv]))
    assert arr[0] == 0 and arr[2] == pytest.approx(KNOWN.throughput(n, kv))
    # below the knee the "other" part is flat: T grows linearly with n at fixed per-sample kv
    assert KNOWN.latency(2, 0) == KNOWN.latency(10, 0)
    assert KNOWN.marginal_gain(3, 300, 100) == pytest.approx(KNOWN.T(4, 400) - KNOWN.T(3, 300))


def test_iterations_closed_form_matches_step_by_step():
    n, kv = 17, 12_345
    for k in (0, 1, 2, 50, 333):
        manual = sum(KNOWN.latency(n, kv + j * n) for j in range(k))
        assert KNOWN.iterations_time(n, kv, k) == pytest.approx(manual, rel=1e-12, abs=1e-15)
    for budget in (0.0, 0.01, 0.5, 3.7, 100.0):
        k = KNOWN.iterations_within(n, kv, budget)
        assert KNOWN.iterations_time(n, kv, k) <= budget
        assert KNOWN.iterations_time(n, kv, k + 1) > budget


def test_peak_throughput_is_at_kv_capacity():
    peak = KNOWN.peak_throughput(5_000, 250_000, 256)
    assert peak == pytest.approx(KNOWN.T(50, 250_000))
    assert peak > KNOWN.T(25, 125_000)


def _rows(model: CostModel, rng, noise=0.0, count=400):
    n = rng.integers(1, 120, count)
    kv = n * rng.integers(200, 8_000, count)
    lat = np.array([model.latency(a, b) for a, b in zip(n, kv)])
    lat = lat * (1 + noise * rng.standard_normal(count))
    return np.column_stack([n, kv, lat])


def test_fit_recovers_known_coefficients_exactly_without_noise():
    rows = _rows(KNOWN, np.random.default_rng(0))
    res = fit(rows, attn_b=KNOWN.attn_b)
    m = res.model
    assert res.rmse < 1e-9
    assert m.attn_k == pytest.approx(KNOWN.attn_k, rel=1e-6)
    assert m.other_k == pytest.approx(KNOWN.other_k, rel=1e-6)
    assert m.other_threshold == pytest.approx(KNOWN.other_threshold, rel=1e-6)
    assert m.other_b == pytest.approx(KNOWN.other_b, rel=1e-5)
    knee = (KNOWN.other_threshold - KNOWN.other_b) / KNOWN.other_k
    assert res.breakpoint_n == pytest.approx(knee, rel=1e-4)


def test_fit_with_noise_from_tuples_and_dicts():
    truth = get_cost_model("qwen_moe_30b")
    rows = _rows(truth, np.random.default_rng(1), noise=0.01, count=2_000)
    as_dicts = [{"n": a, "kv": b, "latency": c} for a, b, c in rows]
    for data in (as_dicts, [tuple(r) for r in rows]):
        m = fit(data).model  # attn_b unknown: only the sums are identifiable
        assert m.attn_k == pytest.approx(truth.attn_k, rel=0.05)
        assert m.other_k == pytest.approx(truth.other_k, rel=0.05)
        assert m.attn_b + m.other_threshold == pytest.approx(truth.attn_b + truth.other_threshold, rel=0.05)
        # predictions match where it matters
        for n, kv in ((1, 1_000), (30, 100_000), (100, 500_000)):
            assert m.latency(n, kv) == pytest.approx(truth.latency(n, kv), rel=0.03)


def test_fit_needs_rows():
    with pytest.raises(ValueError):
        fit([(1, 1, 0.1)])
