"""Rewards with metrics and the reward worker's drop (`drop_rewards`) against a real PostgreSQL:
metrics kept with the reward, a failed reward aborted with `reward_failed` under its claim's
fence (a lost claim is a Conflict that changes nothing, a retry is a no-op), the group dropped
when it can no longer reach N, and the audit's dropped_samples naming the reason."""

from __future__ import annotations

import pytest
from protocol_helpers import Driver

from staleflow_db.errors import Conflict, InvalidInput, NotFound
from workers.wire.enums import DropReason, GroupState


def _claimed(d: Driver, group_size=2, samples_per_group=2):
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    d.finish(d.routed(d.members(g), inst))
    return g, d.p.claim_rewards(d.run, 10)


def test_metrics_are_kept_with_the_reward(engine):
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    g, tasks = _claimed(d)
    a, b = tasks
    (o,) = d.p.record_rewards(
        d.run, [(a.sample_id, a.reward_attempt, 1.0, {"len": 2, "ok": 1.0}), (b.sample_id, b.reward_attempt, 0.5)]
    )
    assert o.state == GroupState.OCCUPIED
    got = dict(d.rows("SELECT id, reward_metrics FROM samples WHERE group_id = :g", g=g))
    assert got == {a.sample_id: {"len": 2.0, "ok": 1.0}, b.sample_id: None}


@pytest.mark.parametrize(
    "metrics, why",
    [({"x": float("nan")}, "finite"), ({"x": "1"}, "finite"), ({"": 1.0}, "characters"), ([1.0], "object")],
)
def test_bad_metrics_are_refused_and_change_nothing(engine, metrics, why):
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    _, (a, b) = _claimed(d)
    with pytest.raises(InvalidInput, match=why):
        d.p.record_rewards(d.run, [(a.sample_id, a.reward_attempt, 1.0, metrics), (b.sample_id, b.reward_attempt, 1.0)])
    assert d.scalars("SELECT DISTINCT state::text FROM samples WHERE run_id = :r") == ["scoring"]


def test_a_dropped_reward_aborts_the_sample_and_its_short_group(engine):
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    g, (a, b) = _claimed(d)
    assert d.p.drop_rewards(d.run, [(a.sample_id, a.reward_attempt)]) == [a.sample_id]
    assert d.sample(a.sample_id)[0::4] == ("aborted", "reward_failed")
    # the group can no longer reach N = 2: it is dropped and its reservation released
    assert d.group(g)[0::4] == ("aborted", DropReason.INSUFFICIENT_MEMBERS.value)
    assert d.buffers() == {1: (0, 0)}
    assert d.sample(b.sample_id)[0::4] == ("aborted", DropReason.INSUFFICIENT_MEMBERS.value)
    # a retry of the same drop changes nothing; the audit names the reason
    assert d.p.drop_rewards(d.run, [(a.sample_id, a.reward_attempt)]) == []
    assert d.rows("SELECT sample_id, reason FROM dropped_samples WHERE run_id = :r AND reason = 'reward_failed'") == [
        (a.sample_id, "reward_failed")
    ]
    assert d.violations() == []


def test_a_group_with_spare_members_survives_a_dropped_reward(engine):
    d = Driver(engine, batch_size=1, group_size=2, samples_per_group=3, eta=1)
    g, tasks = _claimed(d)
    (a, b, c) = tasks
    assert d.p.drop_rewards(d.run, [(a.sample_id, a.reward_attempt)]) == [a.sample_id]
    (o,) = d.p.record_rewards(d.run, [(b.sample_id, b.reward_attempt, 1.0), (c.sample_id, c.reward_attempt, 0.0)])
    assert o.state == GroupState.OCCUPIED
    assert d.violations() == []


def test_a_drop_on_a_lost_claim_is_a_conflict_that_changes_nothing(engine):
    d = Driver(engine, batch_size=1, group_size=2, samples_per_group=3, eta=1)
    _, (a, b, c) = _claimed(d)
    d.p.record_rewards(d.run, [(b.sample_id, b.reward_attempt, 1.0)])
    with pytest.raises(Conflict) as e:
        d.p.drop_rewards(d.run, [(a.sample_id, a.reward_attempt), (b.sample_id, b.reward_attempt)])
    assert [i[0] for i in e.value.items] == [b.sample_id]
    with pytest.raises(Conflict):  # a stale attempt
        d.p.drop_rewards(d.run, [(c.sample_id, c.reward_attempt + 1)])
    assert d.sample(a.sample_id)[0] == "scoring"  # all or nothing
    with pytest.raises(NotFound):
        d.p.drop_rewards(d.run, [(10**9, 1)])
    with pytest.raises(InvalidInput, match="twice"):
        d.p.drop_rewards(d.run, [(a.sample_id, a.reward_attempt)] * 2)
    assert d.scalars("SELECT count(*) FROM samples WHERE run_id = :r AND state = 'aborted'") == [0]
