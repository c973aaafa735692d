import numpy as np
import pytest

from workers.sim.workload import Workload, WorkloadShape


def test_seeded_and_order_independent():
    w1, w2, w3 = Workload(WorkloadShape(), 5), Workload(WorkloadShape(), 5), Workload(WorkloadShape(), 6)
    a = w1.group(10, 16)
    _ = w2.group(3, 16)  # drawing other groups first changes nothing
    b = w2.group(10, 16)
    assert a.prompt_len == b.prompt_len and np.array_equal(a.lengths, b.lengths)
    c = w3.group(10, 16)
    assert not np.array_equal(a.lengths, c.lengths)
    p1, l1 = w1.sample(50, 8)
    p2, l2 = Workload(WorkloadShape(), 5).sample(50, 8)
    assert np.array_equal(p1, p2) and np.array_equal(l1, l2)


def test_long_tailed_with_truncation_fraction():
    shape = WorkloadShape(max_response=20_000, median_fraction=0.2, truncated_fraction=0.05)
    prompts, lengths = Workload(shape, 0).sample(3_000, 8)
    L = lengths.ravel()
    assert L.min() >= 1 and L.max() == shape.max_response
    assert np.median(L) == pytest.approx(4_000, rel=0.1)
    assert L.mean() > 1.3 * np.median(L)  # right-skewed
    assert np.percentile(L, 99) > 4 * np.median(L)
    assert (L >= shape.max_response).mean() == pytest.approx(0.05, abs=0.015)
    assert prompts.min() >= shape.prompt_min and prompts.max() <= shape.prompt_max


def test_shape_is_configurable():
    short = Workload(WorkloadShape(max_response=8_000, median_fraction=0.1, truncated_fraction=0.01), 0)
    st = short.stats(1_000, 8)
    assert st["truncated_fraction"] < 0.03
    assert st["response_median"] == pytest.approx(800, rel=0.15)
    with pytest.raises(ValueError):
        WorkloadShape(truncated_fraction=0.7)


def test_lengths_correlated_within_group():
    def between_share(rho):
        _, lengths = Workload(WorkloadShape(group_correlation=rho, truncated_fraction=0.001), 1).sample(800, 16)
        logs = np.log(lengths)
        within = logs.var(axis=1).mean()
        return 1 - within / logs.var()

    assert between_share(0.0) < 0.1
    assert between_share(0.7) == pytest.approx(0.7, abs=0.1)
