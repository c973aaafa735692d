"""One coordinator cycle (`run_cycle`): what was applied, and only that, reaches the speculative
state — the same function the service and the simulator run."""

from workers.coordinator.admission import AlwaysAdmit
from workers.coordinator.cost_model import get_cost_model
from workers.coordinator.cycle import Applied, run_cycle
from workers.coordinator.policies import CyclePlan, get_policy
from workers.coordinator.state import InstanceSnapshot, QueuedSample, SpeculativeState

COST = get_cost_model("qwen_7b", "TP1_PP1")


def _spec(n=2):
    st = SpeculativeState()
    for i in range(1, n + 1):
        st.observe(InstanceSnapshot(i, 0, 0, 0, 0, 100_000, max_running=64))
    return st


def _queued(n):
    return [QueuedSample(10 + k, 1 + k // 2, 100) for k in range(n)]


def _cycle(st, queued, apply):
    return run_cycle(
        get_policy("strict"), COST, st, queued, apply, ps_version=0, admission=AlwaysAdmit(), group_versions={}
    )


def test_accepted_routes_reach_the_estimates_refused_ones_do_not():
    st, seen = _spec(), []

    def apply(plan: CyclePlan) -> Applied:
        seen.append(plan)
        return Applied([k % 2 == 0 for k in range(len(plan.routes))], [], at=5.0)

    out = _cycle(st, _queued(4), apply)
    assert seen == [out.plan] and len(out.plan.routes) == 4
    assert out.refused == 2
    assert sum(v.requests for v in st.views()) == 2
    assert all(e.last_change_at == 5.0 for e in st.estimates.values() if e.view.requests)


def test_nothing_applied_changes_nothing():
    st = _spec()
    out = _cycle(st, _queued(4), lambda plan: None)  # e.g. deposed while writing
    assert out.plan.routes and out.applied is None and out.refused == 0
    assert sum(v.requests for v in st.views()) == 0


def test_the_services_cycle_history_is_bounded():
    from workers.coordinator.service import CYCLE_HISTORY, CycleStats

    s = CycleStats()
    s.cycle_ms.extend(float(k) for k in range(3 * CYCLE_HISTORY))
    assert len(s.cycle_ms) == CYCLE_HISTORY and s.cycle_ms[-1] == 3 * CYCLE_HISTORY - 1


def test_the_services_queue_reader():
    """Snapshot rows (QueuedView's field order) to the cycle's queue: the samples in order, the
    groups' reservations, closed groups and queue levels; a row unchanged since the last read
    gets the same sample back, a changed one a new sample with its new values."""
    from workers.coordinator.service import QueueReader

    rows = [
        # id, group, v_traj, last_version, length, tokens, group state, reserved buffer, min version, last instance
        [1, 10, None, None, 5, 0, "queued", None, None, None],
        [2, 11, 3, 3, 9, 4, "reserved", 4, 3, 7],
        [3, 11, None, None, 5, 0, "reserved", 4, 3, None],
        [4, 12, 2, 2, 8, 3, "occupied", None, None, 6],
    ]
    reader = QueueReader()
    q = reader.read(rows)
    assert q.samples == [
        QueuedSample(1, 10, 5),
        QueuedSample(2, 11, 9, 3, 4, 3, 7),
        QueuedSample(3, 11, 5),
        QueuedSample(4, 12, 8, 2, 3, 2, 6),
    ]
    assert (q.reserved, q.closed, q.group_versions) == ({11: 4}, {12}, {11: 3})
    changed = [list(r) for r in rows[:3]]
    changed[1][4:6] = [12, 7]  # sample 2 generated 3 more tokens
    again = reader.read(changed)
    assert again.samples[0] is q.samples[0] and again.samples[2] is q.samples[2]
    assert again.samples[1] == QueuedSample(2, 11, 12, 3, 7, 3, 7)
    assert (again.reserved, again.closed, again.group_versions) == ({11: 4}, set(), {11: 3})
