"""The sweep's diagnosis of what a run waits for (bench/policy_sweep.py `diagnose`)."""

from bench.policy_sweep import diagnose


def test_while_the_trainer_waits_its_buffer_would_decode_no_slower_alone():
    setup, policy, eta, d = diagnose(("tiny", "staleflow", 2, 0, 4))
    assert (setup, policy, eta) == ("tiny", "staleflow", 2)
    assert 0.0 <= d["kv_fill"] <= 1.0 and 0.0 <= d["budget_free"] <= 1.0
    # the tiny set-up's trainer waits for its rollout: some of the buffer decodes meanwhile
    assert d["gating_decoding"] > 0
    # an engine runs at least the gating samples themselves, and decodes them no slower alone
    # (the cost model's latency grows with the samples and the KV an engine holds)
    assert d["gating_engine_running"] >= 1.0
    assert d["gating_speedup_alone"] >= 1.0


def test_the_diagnosis_observes_only():
    """The sweep takes strict's and the default's tokens/s from the diagnosed runs: its
    per-cycle sampling must leave the run exactly as `simulate` runs it."""
    from workers.sim.simulator import simulate

    for policy in ("staleflow", "strict"):
        *_, d = diagnose(("tiny", policy, 2, 0, 4))
        assert d["steady_tokens_per_s"] == simulate("tiny", policy, eta=2, steps=4, seed=0).steady_tokens_per_s
