"""Multi-turn trajectories in the data layer: generated turns and environment observations
(segments.generated), the loss mask delivered to the instance, the reward worker and the
trainer, per-turn versions across a migration between turns and an interrupt within one, the
refusals, and the audit's per-turn checks proven by forging the broken state each must catch."""

from __future__ import annotations

import pytest
from audit_helpers import forge, found
from protocol_helpers import Driver
from sqlalchemy.exc import IntegrityError

from staleflow_db.errors import InvalidInput
from staleflow_db.payloads import pack_logprobs, pack_tokens
from staleflow_db.protocol import NodeItem
from staleflow_db.types import Report
from workers.wire.enums import SegmentKind as K
from workers.wire.packed import PackedArray


def _gen(d: Driver, sid: int, attempt: int, version: int, tokens, kind: K) -> None:
    d.p.report(
        d.run, [Report(sid, attempt, version, list(tokens), [-0.5] * len(tokens), kind, **d.route_identity(sid))]
    )


def _obs(d: Driver, sid: int, attempt: int, tokens, kind: K = K.INTERRUPTED) -> None:
    d.p.report(d.run, [Report(sid, attempt, None, list(tokens), [], kind, None, False, **d.route_identity(sid))])


@pytest.fixture
def turns(engine):
    """Sample `a`: turn 1 at version 0 on i0, the environment's observation, back to the queue
    (between turns), migrated to i1 at version 1, turn 2 interrupted within the turn and resumed
    there, finished; trained at step 1 with its group mate `b` (one turn at version 0)."""
    d = Driver(engine, name="turns", batch_size=1, buffer_capacity=2, group_size=2, samples_per_group=2, eta=1)
    i0 = d.p.register_instance(d.run, "i0", 0)
    g_first, g = d.enqueue(2)
    a, b = d.members(g)
    att = d.routed([a, b], i0)
    _gen(d, a, att[a], 0, [1, 2], K.PARTIAL)
    _obs(d, a, att[a], [50, 51])  # the environment's answer; between turns the sample is queued
    assert d.sample(a)[0] == "queued"
    d.finish({b: att[b]}, version=0)
    d.complete(d.members(g_first), i0)  # fills buffer 0
    d.train(0)
    i1 = d.p.register_instance(d.run, "i1", 1)
    att = d.routed([a], i1)
    (work,) = d.p.poll_work(i1).work
    assert (work.prefix_tokens, work.prefix_mask, work.prefix_logprobs) == (
        [1, 2, 50, 51],
        [1, 1, 0, 0],
        [-0.5] * 2 + [0.0] * 2,
    )
    _gen(d, a, att[a], 1, [3], K.INTERRUPTED)  # an interrupt within turn 2
    att = d.routed([a], i1)
    _gen(d, a, att[a], 1, [4], K.FINISHED)
    tasks = {t.sample_id: t for t in d.p.claim_rewards(d.run, 10)}
    assert (tasks[a].response_tokens, tasks[a].response_mask) == ([1, 2, 50, 51, 3, 4], [1, 1, 0, 0, 1, 1])
    d.p.record_rewards(d.run, [(t.sample_id, t.reward_attempt, 1.0) for t in tasks.values()])
    batch = d.p.consume(d.run, 1)
    assert batch is not None
    trained = {s.sample_id: s for grp in batch.groups for s in grp.samples}
    assert trained[a].loss_mask == [1, 1, 0, 0, 1, 1]
    # the segments' stored bytes handed on as they are (sent packed without a list in between)
    assert isinstance(trained[a].tokens, PackedArray) and trained[a].tokens.raw == pack_tokens([1, 2, 50, 51, 3, 4])
    assert trained[a].tokens == [1, 2, 50, 51, 3, 4] and trained[a].logprobs == [-0.5] * 2 + [0.0] * 2 + [-0.5] * 2
    assert [(x.version, x.generated) for x in trained[a].segments] == [(0, True), (None, False), (1, True), (1, True)]
    assert trained[b].loss_mask == [1, 1]
    d.p.publish(d.run, 1, batch.consume_fence)
    assert d.violations() == []
    return d, a


def test_a_trajectory_of_turns_trains_on_generated_tokens_only(turns):
    d, a = turns
    assert d.sample(a)[0] == "rewarded"


def test_observation_refusals_change_nothing(engine):
    d = Driver(engine, name="refuse", batch_size=1, buffer_capacity=1, group_size=1, samples_per_group=1, eta=1)
    i0 = d.p.register_instance(d.run, "i0", 0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    att = d.routed([s], i0)[s]
    ident = d.route_identity(s)
    bad = [
        Report(s, att, 0, [5], [], K.PARTIAL, None, False, **ident),  # a version claim
        Report(s, att, None, [5], [-1.0], K.PARTIAL, None, False, **ident),  # log-probs
        Report(s, att, None, [], [], K.PARTIAL, None, False, **ident),  # nothing observed
        Report(s, att, None, [5], [], K.FINISHED, None, False, **ident),  # ends the trajectory
        Report(s, att, None, [5], [-1.0], K.PARTIAL, **ident),  # generated, no version
    ]
    for r in bad:
        with pytest.raises(InvalidInput):
            d.p.report(d.run, [r])
    _gen(d, s, att, 0, [1], K.PARTIAL)
    _obs(d, s, att, [5], K.PARTIAL)
    with pytest.raises(InvalidInput, match="one observation per turn"):
        _obs(d, s, att, [6], K.PARTIAL)
    assert d.scalars("SELECT count(*) FROM segments WHERE sample_id = :s", s=s) == [2]
    assert d.violations() == []


def test_an_observation_with_a_version_is_refused_by_the_schema(engine, turns):
    d, a = turns
    with pytest.raises(IntegrityError, match="observation_unversioned"):
        forge(engine, "UPDATE segments SET version = 1 WHERE sample_id = :s AND seq = 1", s=a)


# ---- the audit's per-turn checks, each proven by forging what it catches ---------------------


def test_turn_version_catches_a_version_going_down_across_an_observation(engine, turns):
    """Turn 1 at version 1, turn 2 at version 0: neighbouring segments never compare across
    the observation, so only the per-turn check sees it."""
    d, a = turns
    forge(
        engine,
        "UPDATE segments SET version = 1 WHERE sample_id = :s AND seq = 0",
        "UPDATE segments SET version = 0 WHERE sample_id = :s AND seq = 2",
        s=a,
    )
    assert found(engine, d.run) == {("turn_version", f"sample {a}")}


def test_observation_catches_log_probs_on_observed_tokens(engine, turns):
    d, a = turns
    forge(engine, "UPDATE segments SET logprobs = :l WHERE sample_id = :s AND seq = 1", s=a, l=pack_logprobs([-1, 0]))
    assert found(engine, d.run) == {("observation", f"sample {a}")}


def test_observation_catches_two_observations_in_a_row(engine, turns):
    d, a = turns
    forge(
        engine,
        "UPDATE segments SET generated = false, version = NULL, logprobs = :l WHERE sample_id = :s AND seq = 2",
        s=a,
        l=pack_logprobs([0.0]),
    )
    assert found(engine, d.run) == {("observation", f"sample {a}")}


def test_observation_catches_a_trajectory_ending_in_an_observation(engine, turns):
    d, a = turns
    forge(
        engine,
        "UPDATE segments SET generated = false, version = NULL, logprobs = :l WHERE sample_id = :s AND seq = 3",
        s=a,
        l=pack_logprobs([0.0]),
    )
    assert found(engine, d.run) == {("observation", f"sample {a}")}


def test_a_node_sync_refuses_a_second_observation_in_a_turn(engine):
    """The node path reads a sample's last segment for its observation reports too: a batch of
    one generated report and one observation after an observation is refused whole."""
    d = Driver(engine, name="node-obs", batch_size=1, buffer_capacity=1, group_size=2, samples_per_group=2, eta=1)
    i0 = d.p.register_instance(d.run, "i0", 0)
    (g,) = d.enqueue(1)
    a, b = d.members(g)
    att = d.routed([a, b], i0)
    _gen(d, a, att[a], 0, [1], K.PARTIAL)
    _obs(d, a, att[a], [5], K.PARTIAL)
    batch = [
        Report(b, att[b], 0, [2], [-1.0], K.PARTIAL, **d.route_identity(b)),
        Report(a, att[a], None, [6], [], K.PARTIAL, None, False, **d.route_identity(a)),
    ]
    before = d.scalars("SELECT count(*) FROM segments WHERE sample_id IN (:a, :b)", a=a, b=b)
    with pytest.raises(InvalidInput, match="one observation per turn"), engine.begin() as conn:
        d.p.sync_node(d.run, [NodeItem(i0, batch, None, None)], conn=conn)
    assert d.scalars("SELECT count(*) FROM segments WHERE sample_id IN (:a, :b)", a=a, b=b) == before
    # the generated report alone goes through the same path
    with engine.begin() as conn:
        (out,) = d.p.sync_node(d.run, [NodeItem(i0, batch[:1], None, None)], conn=conn)
    assert out.refused is None and out.applied == 1
