"""The coordinator's speculative state: lagging snapshots are dropped, fresh agreeing ones taken."""

from workers.coordinator.state import InstanceSnapshot, RunningSample, SpeculativeState


def snap(t, running=0, waiting=0, kv=0, seen=None, version=0, pulling=False, samples=()):
    return InstanceSnapshot(
        instance_id=1,
        version=version,
        running=running,
        waiting=waiting,
        kv_used=kv,
        kv_capacity=100_000,
        running_samples=tuple(samples),
        heartbeat_at=t,
        snapshot_at=t,
        pulling=pulling,
        routed_seen=seen,
        max_running=1 << 30,
    )


def test_routes_update_the_estimate_at_once():
    st = SpeculativeState()
    assert st.observe(snap(0.0, running=2, kv=2_000, seen=2))
    st.on_route(1, 500, now=1.0)
    st.on_route(1, 500, now=1.0)
    v = st.view(1)
    assert (v.running, v.waiting, v.kv_used) == (4, 0, 3_000)
    st.on_route(1, 200_000, now=1.0)  # does not fit: it waits
    assert st.view(1).waiting == 1


def test_a_lagging_snapshot_is_dropped_and_a_fresh_agreeing_one_accepted():
    st = SpeculativeState()
    st.observe(snap(0.0, seen=0))
    for _ in range(3):
        st.on_route(1, 1_000, now=1.0)
    # taken before the routes: it "looks" empty; taking it would flood the instance
    assert not st.observe(snap(0.9, running=0, seen=0))
    assert st.view(1).running == 3
    # newer, but the engine has not taken in every route yet
    assert not st.observe(snap(1.2, running=2, kv=2_000, seen=2))
    # newer and it has seen all three (one already finished): accepted, replaces the estimate
    assert st.observe(snap(1.5, running=2, kv=2_600, seen=3))
    v = st.view(1)
    assert (v.running, v.kv_used) == (2, 2_600)
    assert st.dropped == 2


def test_without_a_routed_counter_the_request_count_must_agree():
    st = SpeculativeState()
    st.observe(snap(0.0, running=1))
    st.on_route(1, 1_000, now=1.0)
    assert not st.observe(snap(1.1, running=1))  # does not show the routed request yet
    assert st.observe(snap(1.2, running=2, kv=1_500))
    # a disagreement that finishes explain yields once the local change is old enough
    st.on_route(1, 1_000, now=2.0)
    assert not st.observe(snap(2.5, running=2))
    assert st.observe(snap(2.0 + st.expire_after, running=2))


def test_a_snapshot_older_than_the_last_command_is_stale_within_tolerance():
    st = SpeculativeState(tolerance=0.05)
    st.observe(snap(0.0, seen=0))
    st.on_interrupt(1, [], now=1.0)
    assert not st.observe(snap(0.9, seen=0))
    assert st.observe(snap(0.96, seen=0))  # clock skew inside the tolerance
    assert not st.observe(snap(0.95, seen=0))  # not newer than what we have


def test_pull_and_interrupt_updates():
    st = SpeculativeState()
    rs = (RunningSample(7, 100, 400, 0), RunningSample(8, 50, 350, 0))
    st.observe(snap(0.0, running=2, kv=750, seen=2, samples=rs))
    st.on_interrupt(1, [7], now=1.0)
    v = st.view(1)
    assert (v.running, v.kv_used, [s.sample_id for s in v.running_samples]) == (1, 350, [8])
    st.on_pull(1, 3, now=2.0)
    v = st.view(1)
    assert (v.pulling, v.version, v.running, v.kv_used) == (True, 3, 0, 0)
    # still pulling, or not yet on the new version: the pull is not visible, keep the estimate
    assert not st.observe(snap(2.5, seen=2, version=0, pulling=True))
    assert st.view(1).version == 3
    assert st.observe(snap(3.5, seen=2, version=3))
    assert not st.view(1).pulling


def test_views_are_copies_unless_asked():
    st = SpeculativeState()
    st.observe(snap(0.0, seen=0))
    st.views()[0].running = 99
    assert st.view(1).running == 0
    assert st.views(copy=False)[0] is st.view(1)
