"""The coordinator's pure strategies on crafted snapshots."""

import copy
import math
import random

import pytest

from staleflow_db.reference import ReferenceProtocol
from staleflow_db.types import RunConfig
from workers.coordinator.cost_model import get_cost_model
from workers.coordinator.policies import ABLATIONS, BASELINES, Policy, get_policy
from workers.coordinator.state import InstanceView, QueuedSample, RunningSample
from workers.coordinator.strategies import (
    NEW_LEVEL,
    AdmissionView,
    CallbackAdmission,
    PullDecision,
    RouteDecision,
    engine_should_interrupt_preempted,
    finishing_oldest,
    level_of,
    migrate_throughput_ratio,
    oldest_running_version,
    queue_levels,
    routable_versions,
    route_request_count,
    route_waterfall,
    stagger_pulls,
    sync_all_idle,
    sync_greedy,
    sync_status_based,
)
from workers.wire.types import RouteOutcome

COST = get_cost_model("qwen_14b")
CAP = 250_000


def inst(iid, version=0, running=0, kv=None, waiting=0, pulling=False, samples=(), cap=CAP, max_running=1 << 30):
    kv = running * 2_000 if kv is None else kv
    return InstanceView(iid, version, running, waiting, kv, cap, tuple(samples), 0.0, pulling, max_running=max_running)


def fresh(sid, gid=None, length=300):
    return QueuedSample(sid, gid if gid is not None else sid, length)


def partial(sid, v_traj, tokens=1_000, prompt=300, gid=None):
    return QueuedSample(sid, gid if gid is not None else sid, prompt + tokens, v_traj, tokens, v_traj)


# ---- routing ---------------------------------------------------------------------------------


def test_levels_oldest_first_and_fresh_members_of_inflight_groups_take_the_group_version():
    q = [fresh(1, gid=10), partial(2, 3), partial(3, 1), fresh(4, gid=11)]
    levels = queue_levels(q, group_versions={11: 2})
    assert [lv for lv, _ in levels] == [1, 2, 3, NEW_LEVEL]
    assert [s.sample_id for s in levels[1][1]] == [4]
    assert level_of(q[0], {}) == NEW_LEVEL


def test_waterfall_prefers_the_largest_marginal_gain():
    # instance 2 is below the knee of the cost model: adding a sample is almost free there
    views = [inst(1, running=60, kv=200_000), inst(2, running=5, kv=20_000), inst(3, running=40, kv=150_000)]
    routes = route_waterfall(views, [fresh(1)], COST, mu=0.0)
    assert routes == [RouteDecision(1, 2)]
    gains = {v.instance_id: COST.T(v.running + 1, v.kv_used + 300) - COST.T(v.running, v.kv_used) for v in views}
    assert max(gains, key=gains.get) == 2


def test_waterfall_fills_like_water_and_respects_mu():
    views = [inst(1), inst(2)]
    q = [fresh(i, gid=i // 8, length=2_000) for i in range(400)]
    routes = route_waterfall(views, q, COST, mu=0.25)
    per = {1: 0, 2: 0}
    for r in routes:
        per[r.instance_id] += 1
    assert abs(per[1] - per[2]) <= 1  # spread evenly
    assert 0 < len(routes) < 250  # stops when the marginal gain falls under μ·T(1, l)
    n, kv = per[1], per[1] * 2_000
    assert COST.T(n + 1, kv + 2_000) - COST.T(n, kv) < 0.25 * COST.T(1, 2_000)
    # μ = 0 routes until the KV cache is full; a high μ routes only onto empty instances
    assert len(route_waterfall(views, q, COST, mu=0.0)) == 2 * (CAP // 2_000)
    assert len(route_waterfall(views, q, COST, mu=1.0)) == 2


def test_waterfall_serves_the_oldest_level_first():
    views = [inst(1, running=0, max_running=1)]  # room for exactly one sample
    q = [fresh(1), partial(2, 0, tokens=5_000)]
    routes = route_waterfall(views, q, COST, mu=0.0)
    assert [r.sample_id for r in routes] == [2]


def test_a_blocked_old_level_blocks_newer_levels():
    views = [inst(1, version=1), inst(2, version=1)]
    too_big = partial(1, 0, tokens=CAP)  # fits nowhere
    q = [too_big, fresh(2), partial(3, 1)]
    assert route_waterfall(views, q, COST, mu=0.0) == []
    assert route_waterfall(views, q, COST, mu=0.0, block_scope="all") == []
    assert {r.sample_id for r in route_waterfall(views, q[1:], COST, mu=0.0)} == {2, 3}


def test_blocking_spares_instances_too_old_for_the_blocked_level():
    # the old level (V_traj 2) can only run on instance 2, which is full; instance 1 (version 1)
    # could never serve it, so newer work may still go there unless block_scope="all"
    views = [inst(1, version=1), inst(2, version=2, running=10, kv=CAP - 100)]
    q = [partial(1, 2, tokens=3_000), fresh(2)]
    assert route_waterfall(views, q, COST, mu=0.0) == [RouteDecision(2, 1)]
    assert route_waterfall(views, q, COST, mu=0.0, block_scope="all") == []


def test_waterfall_filters_version_waiting_pulling_kv_and_admission():
    q = [partial(1, 3)]
    assert route_waterfall([inst(1, version=2)], q, COST, mu=0.0) == []
    assert route_waterfall([inst(1, version=3)], q, COST, mu=0.0) == [RouteDecision(1, 1)]
    assert route_waterfall([inst(1, version=3, waiting=1)], q, COST, mu=0.0) == []
    assert route_waterfall([inst(1, version=3, pulling=True)], q, COST, mu=0.0) == []
    assert route_waterfall([inst(1, version=3, kv=CAP - 100)], q, COST, mu=0.0) == []
    assert route_waterfall([inst(1, version=3, running=4, max_running=4)], q, COST, mu=0.0) == []
    no = CallbackAdmission(lambda s, v: False)
    assert route_waterfall([inst(1, version=3)], q, COST, no, mu=0.0) == []
    # a sample's latest segment version binds, not only its V_traj
    later = QueuedSample(5, 5, 1_300, 1, 1_000, 3)
    assert route_waterfall([inst(1, version=2)], [later], COST, mu=0.0) == []
    # routed once but interrupted before its first token: V_traj still binds (it only grows)
    empty = QueuedSample(6, 6, 300, 4, 0, None)
    assert route_waterfall([inst(1, version=3)], [empty], COST, mu=0.0) == []


def _reference_waterfall(views, queued, mu, group_versions, admission):
    """Sample by sample, exactly as SPEC §4 words it (slow; the oracle of the matrix form)."""
    state = {v.instance_id: [v.version, v.running, v.kv_used, v.waiting, v.pulling, v.kv_capacity] for v in views}
    routes, blocked = [], set()
    for _level, samples in queue_levels(queued, group_versions):
        failed = []
        for s in samples:
            best, best_gain = None, -math.inf
            for iid, (ver, n, kv, w, pulling, cap) in state.items():
                if iid in blocked or pulling or w or kv + s.length > cap or ver < s.min_instance_version:
                    continue
                if not admission.admits(s, ver):
                    continue
                g = COST.T(n + 1, kv + s.length) - COST.T(n, kv)
                if g > best_gain:
                    best, best_gain = iid, g
            if best is None or best_gain < mu * COST.T(1, s.length):
                failed.append(s.min_instance_version)
                continue
            admission.commit(s, state[best][0])
            state[best][1] += 1
            state[best][2] += s.length
            routes.append(RouteDecision(s.sample_id, best))
        if failed:
            blocked |= {iid for iid, st in state.items() if st[0] >= min(failed)}
    return routes


def _protocol_scenario(rng):
    """A protocol with some groups in flight, and random instances and queue around it."""
    p = ReferenceProtocol(RunConfig(batch_size=4, group_size=2, eta=2, samples_per_group=3))
    p.version = 0
    for k in range(12):
        p.enqueue(f"g{k}", [1] * rng.randint(10, 900))
    iids = [p.register_instance(0) for _ in range(3)]
    gids = sorted(p.groups)
    for gid in gids[:5]:
        p.route([(p.groups[gid].sample_ids[0], rng.choice(iids))])
    views = []
    for i in range(rng.randint(1, 6)):
        n = rng.randint(0, 60)
        views.append(
            inst(i + 1, version=0, running=n, kv=n * rng.randint(100, 6_000), waiting=int(rng.random() < 0.15))
        )
    queued = []
    for sid in p.queued_samples():
        s = p.samples[sid]
        queued.append(QueuedSample(sid, s.group_id, len(p.groups[s.group_id].prompt), s.v_traj, 0))
    for extra in range(rng.randint(0, 6)):  # interrupted partials (groups already in flight)
        gid = rng.choice(gids[:5])
        queued.append(QueuedSample(1000 + extra, gid, rng.randint(100, 20_000), 0, rng.randint(1, 9_000), 0))
    rng.shuffle(queued)
    reserved = {gid: g.reserved_buffer for gid, g in p.reserved.items()}
    gv = {gid: g.min_version for gid, g in p.reserved.items()}
    return p, views, queued, reserved, gv


@pytest.mark.parametrize("seed", range(40))
def test_matrix_waterfall_equals_the_sample_by_sample_rule(seed):
    rng = random.Random(seed)
    p, views, queued, reserved, gv = _protocol_scenario(rng)
    mu = rng.choice([0.0, 0.1, 0.25, 0.5])
    fast = route_waterfall(
        views, queued, COST, AdmissionView(p.buffers, p.version, p.limits, reserved), mu=mu, group_versions=gv
    )
    slow = _reference_waterfall(views, queued, mu, gv, AdmissionView(p.buffers, p.version, p.limits, reserved))
    assert fast == slow


@pytest.mark.parametrize("seed", range(15))
def test_admission_view_answers_what_the_protocol_does(seed):
    rng = random.Random(seed)
    p, _, queued, reserved, _ = _protocol_scenario(rng)
    adm = AdmissionView(p.buffers, p.version, p.limits, reserved)
    shadow = copy.deepcopy(p)
    real = [s for s in queued if s.sample_id in p.samples]
    for s in real:
        ok = adm.admits(s, 0)
        out = shadow.route([(s.sample_id, 1)])[0]
        assert ok == (out.outcome == RouteOutcome.ROUTED), (s, out)
        if ok:
            adm.commit(s, 0)


def test_request_count_routing_is_naive():
    views = [inst(1, running=3, kv=240_000), inst(2, running=5, kv=10_000), inst(3, running=4, waiting=2)]
    q = [fresh(i, length=50_000) for i in range(1, 5)]
    routes = route_request_count(views, q)
    # least requests first, ties by order; KV, waiting queue and throughput are ignored
    assert [r.instance_id for r in routes] == [1, 1, 1, 2]
    assert route_request_count(views, q, max_requests=5) == [RouteDecision(1, 1), RouteDecision(2, 1)]
    assert route_request_count([inst(1, version=0)], [partial(1, 2)]) == []
    assert route_request_count([inst(1, pulling=True)], q) == []


def test_sticky_request_count_routing_resumes_on_the_same_instance():
    views = [inst(1, running=9), inst(2, running=0)]
    back = QueuedSample(7, 7, 1_300, 0, 1_000, 0, last_instance=1)
    assert route_request_count(views, [back], sticky=True) == [RouteDecision(7, 1)]
    assert route_request_count(views, [back]) == [RouteDecision(7, 2)]
    gone = [inst(1, running=9, pulling=True), inst(2)]
    assert route_request_count(gone, [back], sticky=True) == []  # waits for its instance
    assert get_policy("strict").sticky_resume and not get_policy("staleflow").sticky_resume


def test_new_groups_are_not_routed_once_the_staleness_budget_is_full():
    p = ReferenceProtocol(RunConfig(batch_size=1, group_size=1, eta=1))
    p.register_instance(0)
    for k in range(3):
        p.enqueue(f"g{k}", [1])
    p.route([(1, 1), (2, 1)])  # buffers 0 and 1 reserved: (η+1)·B' = 2 groups in flight
    adm = AdmissionView(p.buffers, p.version, p.limits, {g.id: g.reserved_buffer for g in p.reserved.values()})
    assert route_waterfall([inst(1)], [fresh(3)], COST, adm, mu=0.0) == []
    assert route_request_count([inst(1)], [fresh(3)], adm) == []
    assert p.route([(3, 1)])[0].outcome == RouteOutcome.NOT_ADMITTED


# ---- what is routable ------------------------------------------------------------------------


def test_routable_versions():
    q = [partial(1, 2), fresh(2)]
    assert routable_versions([0, 1, 2, 3], q) == {0: True, 1: True, 2: True, 3: True}
    no_new = CallbackAdmission(lambda s, v: s.tokens > 0)
    assert routable_versions([0, 1, 2, 3], q, no_new) == {0: False, 1: False, 2: True, 3: True}
    assert routable_versions([0, 2], q, no_new, exclude={1}) == {0: False, 2: False}


# ---- synchronization -------------------------------------------------------------------------


def test_status_based_pull_never_pulls_an_instance_with_work_left():
    views = [
        inst(1, version=1),  # behind, idle, nothing routable at v1 -> pulls
        inst(2, version=0),  # behind, but work is routable at v0 -> stays
        inst(3, version=1, waiting=1),  # waiting queue -> stays
        inst(4, version=1, running=80, kv=200_000),  # KV above the threshold -> stays
        inst(5, version=2),  # up to date
        inst(6, version=1, pulling=True),
        inst(7, version=1, running=3, kv=30_000),  # lightly loaded: pulls (interrupting its 3)
    ]
    routable = {0: True, 1: False, 2: True}
    pulls = sync_status_based(views, 2, routable, kv_threshold=0.3)
    assert pulls == [PullDecision(1, 2), PullDecision(7, 2)]


def test_status_based_pull_with_a_callable_and_threshold():
    views = [inst(1, version=0, running=10, kv=100_000)]
    assert sync_status_based(views, 1, lambda v: False, kv_threshold=0.3) == []
    assert sync_status_based(views, 1, lambda v: False, kv_threshold=0.5) == [PullDecision(1, 1)]
    assert sync_status_based(views, 1, lambda v: True, kv_threshold=1.0) == []
    assert sync_status_based(views, 0, lambda v: False, kv_threshold=1.0) == []


def test_status_based_pull_keeps_running_samples_when_no_work_waits_for_the_new_version():
    views = [inst(1, version=0, running=3, kv=30_000), inst(2, version=0)]
    never = lambda v: False  # noqa: E731
    # nothing can run at the PS version: the busy instance keeps draining, the empty one pulls
    assert sync_status_based(views, 1, never, kv_threshold=0.3, new_work=False) == [PullDecision(2, 1)]
    both = [PullDecision(1, 1), PullDecision(2, 1)]
    assert sync_status_based(views, 1, never, kv_threshold=0.3, new_work=True) == both
    assert sync_status_based(views, 1, never, kv_threshold=0.3) == both  # unknown: the rule is off


def test_an_instance_about_to_finish_the_oldest_samples_does_not_pull():
    rs = lambda sid, v, tokens: RunningSample(sid, tokens, 300 + tokens, v)  # noqa: E731
    # after publishing v3 at η = 1: instance 1 runs a straggler routed at v1 (the buffer the
    # trainer waits for) 100 tokens short of the 2,000 maximum; instance 2 one of v1 that may
    # run 1,900 more; instance 3 a sample of v2; instance 4 nothing
    views = [
        inst(1, version=2, running=1, kv=2_200, samples=[rs(10, 1, 1_900)]),
        inst(2, version=2, running=1, kv=400, samples=[rs(11, 1, 100)]),
        inst(3, version=2, running=1, kv=400, samples=[rs(12, 2, 100)]),
        inst(4, version=2),
    ]
    assert oldest_running_version(views) == 1 and oldest_running_version([inst(5)]) is None
    step = COST.latency(1, 2_200)
    # at most 100 iterations left on instance 1: kept within a horizon of 100 iterations
    assert finishing_oldest(views, COST, 2_000, horizon=100 * step * 1.01) == {1}
    assert finishing_oldest(views, COST, 2_000, horizon=99 * step) == set()
    assert finishing_oldest(views, COST, None, horizon=1e9) == set()  # no bound, nothing kept
    never = lambda v: False  # noqa: E731
    pulls = sync_status_based(views, 3, never, kv_threshold=0.3, new_work=True, keep={1})
    assert pulls == [PullDecision(2, 3), PullDecision(3, 3), PullDecision(4, 3)]


def test_plan_asks_whether_work_waits_at_the_ps_version():
    # one instance behind with 3 running samples and an empty queue (the staleness budget is
    # full): nothing waits for v1, so it keeps its samples; without the rule it pulls
    views = [inst(1, version=0, running=3, kv=30_000), inst(2, version=1, running=60, kv=240_000)]
    queued: list[QueuedSample] = []
    gate = get_policy("staleflow", migration=False).plan(views, queued, COST, ps_version=1)
    assert gate.pulls == []
    off = get_policy("staleflow", migration=False, pull_for_new_work=False).plan(views, queued, COST, ps_version=1)
    assert off.pulls == [PullDecision(1, 1)]


def test_pulls_are_staggered_to_the_ps_streams_least_loaded_first():
    views = [
        inst(1, running=5),
        inst(2, running=0),
        inst(3, running=2),
        inst(4, pulling=True),
        inst(5, running=2, kv=1),
    ]
    pulls = [PullDecision(i, 1) for i in (1, 2, 3, 5)]
    assert stagger_pulls(views, pulls, None) == pulls  # capacity not known: no limit
    assert stagger_pulls(views, pulls, 10) == pulls
    # 3 streams, one held by instance 4: two more, the emptiest instances first (KV breaks the tie)
    assert stagger_pulls(views, pulls, 3) == [PullDecision(2, 1), PullDecision(5, 1)]
    assert stagger_pulls(views, pulls, 1) == []  # every stream busy: all wait
    assert stagger_pulls(views, pulls, 1, depth=2) == [PullDecision(2, 1)]  # one more per stream
    # the staleflow plan defers the rest (2 per stream); strict (greedy) pulls everyone at once
    behind = [inst(i, version=0) for i in range(1, 7)]
    assert len(get_policy("staleflow").plan(behind, [], COST, ps_version=1, pull_streams=2).pulls) == 4
    assert len(get_policy("staleflow").plan(behind, [], COST, ps_version=1).pulls) == 6
    assert len(get_policy("staleflow", pull_depth=None).plan(behind, [], COST, ps_version=1, pull_streams=2).pulls) == 6
    assert len(get_policy("strict").plan(behind, [], COST, ps_version=1, pull_streams=2).pulls) == 6


def test_greedy_pull_is_naive_and_all_idle_waits_for_everyone():
    views = [
        inst(1, version=0, running=50, kv=200_000, waiting=3),
        inst(2, version=1),
        inst(3, version=0, pulling=True),
    ]
    assert sync_greedy(views, 1) == [PullDecision(1, 1)]
    idle = [inst(1, version=0), inst(2, version=0)]
    assert sync_all_idle(idle, 1, {0: False}) == [PullDecision(1, 1), PullDecision(2, 1)]
    assert sync_all_idle(idle, 1, {0: True}) == []
    assert sync_all_idle([inst(1, version=0), inst(2, version=0, running=1)], 1, {0: False}) == []
    assert sync_all_idle(idle, 0, {0: False}) == []


# ---- migration -------------------------------------------------------------------------------


def _samples(n, base_sid=100, tokens_step=500, prompt=300):
    return [RunningSample(base_sid + i, (i + 1) * tokens_step, prompt + (i + 1) * tokens_step, 0) for i in range(n)]


def test_migration_fires_past_psi_and_moves_the_longest_samples():
    loaded_samples = _samples(80)
    loaded = inst(1, running=80, kv=sum(s.length for s in loaded_samples), samples=loaded_samples, cap=2_000_000)
    starved = inst(2, running=2, kv=4_000, cap=2_000_000)
    views = [loaded, starved]
    assert COST.T(loaded.running, loaded.kv_used) > 2.0 * COST.T(starved.running, starved.kv_used)
    out = migrate_throughput_ratio(views, {0: False}, COST, psi=2.0)
    assert len(out) == 1 and out[0].instance_id == 1 and out[0].reason == "migration"
    moved = out[0].sample_ids
    assert 0 < len(moved) <= (80 - 2) // 2
    longest = sorted(loaded_samples, key=lambda s: -s.tokens)
    assert list(moved) == [s.sample_id for s in longest[: len(moved)]]


def test_migration_does_not_fire_below_psi_or_with_routable_work():
    loaded_samples = _samples(80)
    loaded = inst(1, running=80, kv=sum(s.length for s in loaded_samples), samples=loaded_samples, cap=2_000_000)
    starved = inst(2, running=2, kv=4_000, cap=2_000_000)
    ratio = COST.T(80, loaded.kv_used) / COST.T(2, 4_000)
    assert migrate_throughput_ratio([loaded, starved], {0: False}, COST, psi=ratio * 1.01) == []
    assert migrate_throughput_ratio([loaded, starved], {0: True}, COST, psi=2.0) == []  # not starved
    # the starved instance is older than the loaded one: it may not continue its samples
    old = inst(2, version=0, running=2, kv=4_000, cap=2_000_000)
    newer = inst(1, version=1, running=80, kv=loaded.kv_used, samples=loaded_samples, cap=2_000_000)
    assert migrate_throughput_ratio([newer, old], {0: False, 1: False}, COST, psi=2.0) == []


def test_migration_skips_moves_that_gain_nothing():
    # below the knee every sample decodes at the same speed: the ratio trigger alone would fire
    small = _samples(6, tokens_step=100)
    a = inst(1, running=6, kv=sum(s.length for s in small), samples=small)
    b = inst(2, running=0, kv=0)
    assert COST.T(6, a.kv_used) > 2.0 * COST.T(0, 0)
    assert migrate_throughput_ratio([a, b], {0: False}, COST, psi=2.0) == []


def test_engine_side_phi_wait_rule():
    assert engine_should_interrupt_preempted(3, 2)
    assert not engine_should_interrupt_preempted(2, 2)
    assert not engine_should_interrupt_preempted(100, None)


# ---- policies --------------------------------------------------------------------------------


def test_policy_table():
    assert get_policy("sync").eta == 0 and get_policy("one_step").eta == 1
    assert get_policy("strict").effective_eta(3) == 3
    s = get_policy("staleflow")
    assert (s.routing, s.sync, s.migration, s.engine_migration) == ("waterfall", "status", True, True)
    assert get_policy("staleflow-naive-route").routing == "request_count"
    assert get_policy("staleflow-greedy-pull").sync == "greedy"
    nm = get_policy("staleflow-no-migration")
    assert not nm.migration and nm.phi is None
    assert get_policy("staleflow", mu=0.3, psi=3.0).mu == 0.3
    assert set(BASELINES) | set(ABLATIONS) <= {"sync", "one_step", "strict", "staleflow", *ABLATIONS}
    with pytest.raises(KeyError):
        get_policy("nope")
    with pytest.raises(ValueError):
        Policy("x", routing="random")


def test_plan_routes_then_syncs_then_migrates():
    views = [inst(1, version=0), inst(2, version=1)]
    q = [partial(1, 1)]
    plan = get_policy("staleflow").plan(views, q, COST, ps_version=1)
    assert plan.routes == [RouteDecision(1, 2)]
    assert plan.pulls == [PullDecision(1, 1)]  # nothing left for version 0
    strict = get_policy("strict").plan([inst(1, version=0, running=20, kv=60_000)], [], COST, ps_version=1)
    assert strict.pulls == [PullDecision(1, 1)]
    busy = inst(1, version=0, running=20, kv=60_000)
    stay = get_policy("staleflow").plan([busy], [fresh(9)], COST, ps_version=1)
    assert stay.routes == [RouteDecision(9, 1)] and stay.pulls == []  # it just got work at version 0
    full = get_policy("staleflow", mu=1.0).plan([busy], [fresh(9)], COST, ps_version=1)
    assert full.routes == [] and full.pulls == []  # work still routable at version 0: no pull
    # greedy pulls are decided first, so nothing is routed onto an instance about to pull
    greedy = get_policy("strict").plan([busy, inst(2, version=1)], [fresh(9)], COST, ps_version=1)
    assert greedy.pulls == [PullDecision(1, 1)] and greedy.routes == [RouteDecision(9, 2)]
