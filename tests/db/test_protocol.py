"""Each protocol operation against a real PostgreSQL: happy paths, refusals that change nothing,
fencing, the group-join rule, version raise, redundancy, the DAPO filter, abort-after-ready,
and interrupt/resume keeping every token."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from protocol_helpers import Driver
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from staleflow_db.errors import Conflict, InvalidInput, NotFound, TooLarge
from staleflow_db.protocol import Prompt
from staleflow_db.schema import ENUM_TYPES
from staleflow_db.types import Report, RunConfig
from workers.wire.enums import GroupState, SegmentKind
from workers.wire.types import RouteOutcome


def test_database_enums_mirror_python(engine):
    with engine.connect() as c:
        for name, py_enum in ENUM_TYPES.items():
            labels = (
                c.execute(
                    text(
                        "SELECT e.enumlabel FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid"
                        " WHERE t.typname = :n ORDER BY e.enumsortorder"
                    ),
                    {"n": name},
                )
                .scalars()
                .all()
            )
            assert labels == [m.value for m in py_enum], name


def test_create_run_refuses_bad_config_and_duplicate_names(engine):
    d = Driver(engine, batch_size=2, group_size=2, eta=1)
    with pytest.raises(InvalidInput, match="buffer_capacity"):
        d.p.create_run("x", RunConfig(batch_size=2, group_size=1, eta=1, buffer_capacity=1))
    with pytest.raises(InvalidInput, match="eta"):
        d.p.create_run("x", RunConfig(batch_size=2, group_size=1, eta=-1))
    with pytest.raises(Conflict, match="exists"):
        d.p.create_run("test", RunConfig(batch_size=2, group_size=1, eta=1))
    assert d.scalars("SELECT count(*) FROM runs") == [1]


def test_enqueue_is_idempotent_by_client_key_and_validates(engine):
    d = Driver(engine, batch_size=2, group_size=2, samples_per_group=3, eta=1, max_prompt_tokens=4)
    first = d.p.enqueue(d.run, [Prompt("a", [1]), Prompt("b", [2, 3])])
    again = d.p.enqueue(d.run, [Prompt("b", [9]), Prompt("a", [1]), Prompt("c", [4])])
    assert again[:2] == [first[1], first[0]]
    assert d.scalars("SELECT count(*) FROM samples WHERE run_id = :r") == [9]  # N' = 3 per group
    for bad, why in [
        ([Prompt("d", [])], "tokens"),
        ([Prompt("d", [1] * 5)], "tokens"),
        ([Prompt("d", [-1])], "integers"),
        ([Prompt("d", [1]), Prompt("d", [2])], "twice"),
    ]:
        with pytest.raises(InvalidInput, match=why):
            d.p.enqueue(d.run, bad)
    assert d.scalars("SELECT count(*) FROM prompt_groups WHERE run_id = :r") == [3]
    with pytest.raises(NotFound):
        d.p.enqueue(12345, [Prompt("x", [1])])


def test_admission_control_bounds_groups_in_flight(engine):
    """At most (eta+1)·B' groups are reserved; the rest stay queued until a buffer is consumed."""
    d = Driver(engine, batch_size=2, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    groups = d.enqueue(6)
    results = d.route([d.members(g)[0] for g in groups], inst)
    assert [r.outcome for r in results] == [RouteOutcome.ROUTED] * 4 + [RouteOutcome.NOT_ADMITTED] * 2
    assert [r.buffer for r in results[:4]] == [1, 1, 0, 0]  # Reserve takes the latest buffer first
    assert d.sample(d.members(groups[4])[0])[0] == "queued"
    assert d.buffers() == {0: (0, 2), 1: (0, 2)}


def test_occupy_places_greedily_and_training_follows_versions(engine):
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    g1, g2 = d.enqueue(2)
    d.routed(d.members(g1), inst)  # reserves buffer 1 (latest)
    outcomes = d.complete(d.members(g2), inst)  # g2 reserves buffer 0, finishes first
    assert [(o.state, o.buffer) for o in outcomes] == [(GroupState.OCCUPIED, 0)]
    with pytest.raises(Conflict, match="version 0"):
        d.p.consume(d.run, 1)
    d.train(0)
    assert d.group(g2)[0] == "consumed"
    assert d.violations() == []


def test_release_moves_an_earlier_reservation_later(engine):
    """When a group occupies an earlier buffer than it reserved, an earlier reservation whose
    window still contains the freed slot moves into it (SPEC §2, Occupy)."""
    d = Driver(engine, batch_size=1, buffer_capacity=2, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    h1, h2, h3 = d.enqueue(3)
    d.routed(d.members(h1), inst)  # buffer 1
    d.routed(d.members(h2), inst)  # buffer 1 (capacity 2)
    d.routed(d.members(h3), inst)  # buffer 0
    d.finish({d.members(h1)[0]: 1})
    d.reward_all()  # h1 lands in buffer 0 (earliest); its slot in buffer 1 is taken by h3
    assert d.group(h1)[:3] == ("occupied", None, 0)
    assert d.group(h3)[1] == 1
    assert d.buffers() == {0: (1, 0), 1: (0, 2)}
    assert d.violations() == []


def test_a_finished_group_overtakes_an_earlier_reservation(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    g1, g2 = d.enqueue(2)
    d.finish(d.routed(d.members(g1), inst))  # reserved buffer 1
    d.routed(d.members(g2), inst)  # reserved buffer 0
    d.reward_all()  # g1's release lets g2 move to buffer 1, and g1 lands in buffer 0
    assert d.group(g1)[:3] == ("occupied", None, 0)
    assert d.group(g2)[:2] == ("reserved", 1)
    d.train(0)  # one step earlier than without the move


def test_group_join_rule(engine):
    """A later member joins only if the group's buffer lies in its window: V + eta >= b_g."""
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    old = d.p.register_instance(d.run, "old", 0)
    g1, g2, g3 = d.enqueue(3)
    d.routed(d.members(g1)[:1], old)  # g1 holds buffer 1
    d.complete(d.members(g2), old)  # g2 fills buffer 0
    d.train(0)
    new = d.p.register_instance(d.run, "new", 1)
    first, second = d.members(g3)
    assert d.routed([first], new)  # version 1: window [1, 2], buffer 1 is full -> buffer 2
    assert d.group(g3)[1] == 2
    assert d.route([second], old)[0].outcome == RouteOutcome.JOIN_REFUSED  # 0 + 1 < 2
    assert d.sample(second)[0] == "queued"
    assert d.route([second], new)[0].outcome == RouteOutcome.ROUTED


def test_version_raise_and_too_old(engine):
    d = Driver(engine, batch_size=1, group_size=1, samples_per_group=1, eta=2)
    v0 = d.p.register_instance(d.run, "v0", 0)
    g_partial, g_fill, g_fresh = d.enqueue(3)
    (partial,) = d.members(g_partial)
    attempt = d.routed([partial], v0)[partial]
    d.p.report(d.run, [Report(partial, attempt, 0, [5], [-1.0], SegmentKind.INTERRUPTED, **d.route_identity(partial))])
    d.complete(d.members(g_fill), v0)
    d.train(0)
    v1 = d.p.register_instance(d.run, "v1", 1)
    (fresh,) = d.members(g_fresh)
    (r,) = d.route([fresh], v1)
    assert r.v_traj == 1  # a fresh sample takes the newer version
    d.p.report(
        d.run, [Report(fresh, r.attempt, 1, [], [], SegmentKind.INTERRUPTED, **d.route_identity(fresh))]
    )  # no token yet
    assert d.route([fresh], v0)[0].outcome == RouteOutcome.TOO_OLD  # V_traj never goes back
    (r,) = d.route([partial], v1)
    assert r.v_traj == 0  # tokens at version 0 keep V_traj 0 on a newer instance
    d.p.report(
        d.run, [Report(partial, r.attempt, 1, [6], [-1.0], SegmentKind.INTERRUPTED, **d.route_identity(partial))]
    )
    # its latest segment is at version 1: an instance at 0 would make versions decrease
    assert d.route([partial], v0)[0].outcome == RouteOutcome.TOO_OLD
    (r,) = d.route([partial], v1)
    with pytest.raises(InvalidInput, match="version 0 outside 1"):
        d.p.report(
            d.run, [Report(partial, r.attempt, 0, [8], [-1.0], SegmentKind.FINISHED, **d.route_identity(partial))]
        )
    d.p.report(d.run, [Report(partial, r.attempt, 1, [8], [-1.0], SegmentKind.FINISHED, **d.route_identity(partial))])
    assert d.violations() == []


def test_fencing_refuses_stale_attempts_and_changes_nothing(engine):
    d = Driver(engine, batch_size=1, group_size=1, samples_per_group=2, eta=1)
    a, b = d.p.register_instance(d.run, "a", 0), d.p.register_instance(d.run, "b", 0)
    (g,) = d.enqueue(1)
    s, t = d.members(g)
    att = d.routed([s, t], a)
    old = d.route_identity(s)
    d.p.report(d.run, [Report(s, att[s], 0, [1, 2], [-0.1, -0.2], SegmentKind.INTERRUPTED, **old)])
    att2 = d.routed([s], b)  # continues elsewhere with a new attempt
    assert att2[s] == att[s] + 1
    before = d.rows("SELECT * FROM segments ORDER BY sample_id, seq")
    with pytest.raises(Conflict, match="route lost"):  # the late result of the old route
        d.p.report(
            d.run, [Report(t, att[t], 0, [3], [-0.3], **d.route_identity(t)), Report(s, att[s], 0, [9], [-0.9], **old)]
        )
    assert d.rows("SELECT * FROM segments ORDER BY sample_id, seq") == before
    assert d.sample(t)[0] == "running"  # the good report in the refused batch was not applied either
    now = d.route_identity(s)
    for bad, err in [
        (Report(s, att2[s], 0, [1], [], **now), InvalidInput),
        (Report(s, att2[s], 5, [1], [-1.0], **now), InvalidInput),
        (Report(s, att2[s], 0, [1] * 2000, [-1.0] * 2000, **now), TooLarge),
        (Report(s, att2[s], 0, [1], [-1.0], instance_id=b, route_token="guess"), InvalidInput),
        (Report(999999, 1, 0, [1], [-1.0], **now), NotFound),
        (Report(s, att2[s], 0, [1], [-1.0], instance_id=999999, route_token=now["route_token"]), NotFound),
    ]:
        with pytest.raises(err):
            d.p.report(d.run, [bad])
    with pytest.raises(NotFound, match="run 424242"):  # the run is read with the instances
        d.p.report(424242, [Report(s, att2[s], 0, [1], [-1.0], **now)])
    with pytest.raises(NotFound, match="run 424242"):  # asked for only when nothing was claimed
        d.p.claim_rewards(424242, 10)
    assert d.rows("SELECT * FROM segments ORDER BY sample_id, seq") == before


def test_expired_instance_is_fenced_and_its_samples_requeued_with_their_tokens(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "dies", 0, lease_seconds=30)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    att = d.routed([s], inst)[s]
    identity = d.route_identity(s)
    d.p.report(d.run, [Report(s, att, 0, [4, 5], [-0.4, -0.5], SegmentKind.PARTIAL, **identity)])
    assert d.p.expire_instances(d.run) == []  # instance lease still valid
    with engine.begin() as c:
        c.execute(text("UPDATE instances SET lease_expires_at = now() - interval '1 s'"))
    assert d.p.expire_instances(d.run) == [inst]
    assert d.sample(s)[:4] == ("queued", 0, att, 2)
    with pytest.raises(Conflict):
        d.p.report(d.run, [Report(s, att, 0, [6], [-0.6], **identity)])
    with pytest.raises(Conflict, match="expired"):
        d.p.heartbeat(inst, 0)
    with pytest.raises(Conflict, match="expired"):
        d.p.poll_work(inst)
    with pytest.raises(NotFound, match="instance 424242"):  # the check shares the delivery's statement
        d.p.poll_work(424242)
    fresh = d.p.register_instance(d.run, "restarted", 0)
    assert fresh != inst
    d.routed([s], fresh)
    (work,) = d.p.poll_work(fresh).work
    assert (work.prefix_tokens, work.max_new_tokens) == ([4, 5], 1024 - 2)


def test_one_poll_delivers_work_and_commands_together(engine):
    """A poll's reply is one shape: the work routed and the commands pending since the last
    poll come together, and a poll with nothing has both parts empty."""
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    inst = d.p.register_instance(d.run, "i1", 0)
    (g,) = d.enqueue(1)
    a, b = d.members(g)
    d.routed([a, b], inst)
    assert d.p.interrupt(d.run, [a]) == 1  # routed, not yet delivered
    polled = d.p.poll_work(inst)
    assert sorted(w.sample_id for w in polled.work) == [a, b]
    assert [(c.kind, c.sample_id) for c in polled.commands] == [("interrupt", a)]
    again = d.p.poll_work(inst)
    assert (again.work, again.commands) == ([], [])


def test_a_poll_delivers_its_commands_in_order_once(engine):
    """The commands come in the order they were sent, each once."""
    d = Driver(engine, batch_size=1, group_size=3, eta=1)
    inst = d.p.register_instance(d.run, "i1", 0)
    (g,) = d.enqueue(1)
    members = d.members(g)
    d.routed(members, inst)
    for s in reversed(members):  # command ids ascend in this order
        assert d.p.interrupt(d.run, [s]) == 1
    polled = d.p.poll_work(inst)
    assert sorted(w.sample_id for w in polled.work) == members
    assert [c.sample_id for c in polled.commands] == list(reversed(members))
    assert [c.id for c in polled.commands] == sorted(c.id for c in polled.commands)
    assert d.p.poll_work(inst).commands == []


def test_an_abort_committed_while_the_poll_waits_comes_with_that_poll(engine):
    """A routed sample the poll finds aborted once its lock is granted is not delivered, and
    the abort's command is (the commands are read after the sample locks, in the same round
    trip): the instance hears of every sample routed to it in one poll."""
    d = Driver(engine, batch_size=1, group_size=2, samples_per_group=3, eta=1)
    inst = d.p.register_instance(d.run, "i1", 0)
    (g,) = d.enqueue(1)
    a, b, _ = d.members(g)  # a spare member: aborting one leaves the group its N live members
    att = d.routed([a, b], inst)
    with engine.connect() as holder, ThreadPoolExecutor(1) as pool:
        tx = holder.begin()
        holder.execute(text("SELECT 1 FROM samples WHERE id = :s FOR UPDATE"), {"s": a})
        polled = pool.submit(d.p.poll_work, inst)
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        deadline = time.monotonic() + 30
        while d.scalars(waiting) != [1]:
            assert time.monotonic() < deadline, "the poll never waited on the sample's lock"
            time.sleep(0.005)
        assert d.p.abort_samples(d.run, [a], conn=holder) == [a]
        tx.commit()
        got = polled.result()
    assert [w.sample_id for w in got.work] == [b]
    assert [(c.kind, c.sample_id, c.attempt) for c in got.commands] == [("abort", a, att[a])]


def test_a_poll_is_idle_only_when_it_would_answer_empty(engine):
    """`poll_idle` (a long-poll's re-check without a transaction) says idle only when the poll
    would deliver nothing, renew nothing, refuse nothing and replay nothing."""
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i1", 0, lease_seconds=60)
    assert d.p.poll_idle(inst) and d.p.poll_idle(inst, "never-used")
    assert not d.p.poll_idle(424242)  # its poll: 404
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    d.routed([s], inst)
    assert not d.p.poll_idle(inst)  # work to deliver
    assert [w.sample_id for w in d.p.poll_work(inst).work] == [s]
    assert d.p.poll_idle(inst)
    assert d.p.interrupt(d.run, [s]) == 1
    assert not d.p.poll_idle(inst)  # a command to deliver
    d.p.poll_work(inst)
    with engine.begin() as c:
        c.execute(text("INSERT INTO idempotency (request_id, operation, response) VALUES ('k1', 'poll#', '{}')"))
    assert d.p.poll_idle(inst) and not d.p.poll_idle(inst, "k1")  # a retry replays
    with engine.begin() as c:  # a quarter of the lease gone: the poll renews it
        c.execute(text("UPDATE instances SET lease_expires_at = now() + interval '40 s' WHERE id = :i"), {"i": inst})
    assert not d.p.poll_idle(inst)
    d.p.poll_work(inst)
    assert d.p.poll_idle(inst)
    with engine.begin() as c:  # lapsed: the poll refuses it (409)
        c.execute(text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"), {"i": inst})
    assert not d.p.poll_idle(inst)


def test_a_claim_is_idle_only_when_it_would_answer_empty(engine):
    """`claim_idle` (a claim long-poll's re-check without a transaction) says idle only when
    the claim would take nothing, free no expired claim and replay nothing."""
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    inst = d.p.register_instance(d.run, "i1", 0)
    assert d.p.claim_idle(d.run) and d.p.claim_idle(d.run, "never-used")
    assert not d.p.claim_idle(424242)  # its claim: 404
    (g,) = d.enqueue(1)
    a, b = d.members(g)
    d.finish(d.routed([a, b], inst))
    assert not d.p.claim_idle(d.run)  # two finished samples to claim
    (ta,) = d.p.claim_rewards(d.run, 1, claim_seconds=60)
    assert not d.p.claim_idle(d.run)  # one still finished
    (tb,) = d.p.claim_rewards(d.run, 1, claim_seconds=60)
    assert d.p.claim_idle(d.run) and d.p.claim_rewards(d.run, 10) == []
    with engine.begin() as c:  # a claim lapsed: the next claim takes it back
        c.execute(
            text("UPDATE samples SET reward_deadline = now() - interval '1 s' WHERE id = :s"), {"s": tb.sample_id}
        )
    assert not d.p.claim_idle(d.run)
    assert [t.sample_id for t in d.p.claim_rewards(d.run, 10)] == [tb.sample_id]
    assert d.p.claim_idle(d.run)
    with engine.begin() as c:
        c.execute(text("INSERT INTO idempotency (request_id, operation, response) VALUES ('c1', 'claim#', '{}')"))
    assert d.p.claim_idle(d.run) and not d.p.claim_idle(d.run, "c1")  # a retry replays
    assert ta.sample_id == a


def test_interrupt_and_resume_keep_every_token_and_logprob(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    i1, i2 = d.p.register_instance(d.run, "i1", 0), d.p.register_instance(d.run, "i2", 0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    d.routed([s], i1)
    (w,) = d.p.poll_work(i1).work
    assert (w.prompt_tokens, w.prefix_tokens) == ([1, 2, 3], [])
    assert d.p.interrupt(d.run, [s]) == 1
    (cmd,) = d.p.poll_work(i1).commands
    assert (cmd.kind, cmd.sample_id, cmd.attempt) == ("interrupt", s, w.attempt)
    assert w.route_token == d.route_identity(s)["route_token"]  # delivered with the work
    d.p.report(
        d.run,
        [
            Report(
                s, w.attempt, 0, [10, 11], [-1.0, -1.1], SegmentKind.PARTIAL, instance_id=i1, route_token=w.route_token
            )
        ],
    )
    d.p.report(
        d.run,
        [Report(s, w.attempt, 0, [12], [-1.2], SegmentKind.INTERRUPTED, instance_id=i1, route_token=w.route_token)],
    )
    d.routed([s], i2)
    (w2,) = d.p.poll_work(i2).work
    assert (w2.prefix_tokens, w2.prefix_logprobs) == ([10, 11, 12], pytest.approx([-1.0, -1.1, -1.2]))
    assert w2.route_token != w.route_token  # a fresh token for every route
    d.p.report(
        d.run,
        [
            Report(
                s, w2.attempt, 0, [13], [-1.3], SegmentKind.FINISHED, "eos", instance_id=i2, route_token=w2.route_token
            )
        ],
    )
    d.reward_all()
    batch = d.p.consume(d.run, 0)
    (sample,) = batch.groups[0].samples
    assert sample.tokens == [10, 11, 12, 13]
    assert sample.logprobs == pytest.approx([-1.0, -1.1, -1.2, -1.3])
    assert [(x.instance_id, x.n_tokens) for x in sample.segments] == [(i1, 2), (i1, 1), (i2, 1)]
    d.p.publish(d.run, 0, batch.consume_fence)
    (row,) = d.rows("SELECT segment_instances, n_tokens, staleness FROM trained_samples WHERE run_id = :r")
    assert row == ([i1, i1, i2], 4, 0)


def test_group_redundancy_aborts_surplus_members(engine):
    d = Driver(engine, batch_size=1, group_size=2, samples_per_group=4, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    m = d.members(g)
    att = d.routed(m, inst)
    d.finish({k: att[k] for k in m[:2]})
    assert [o.state for o in d.reward_all()] == [GroupState.OCCUPIED]
    assert [d.sample(k)[0] for k in m] == ["rewarded", "rewarded", "aborted", "aborted"]
    assert d.scalars("SELECT DISTINCT reason FROM dropped_samples WHERE run_id = :r") == ["surplus"]
    cmds = d.p.poll_work(inst).commands
    assert sorted((c.kind, c.sample_id) for c in cmds) == [("abort", m[2]), ("abort", m[3])]
    with pytest.raises(Conflict):  # the instance's late result for an aborted member
        d.finish({m[2]: att[m[2]]})


def test_batch_redundancy_and_abort_after_ready(engine):
    d = Driver(engine, batch_size=1, buffer_capacity=2, group_size=1, eta=0)
    inst = d.p.register_instance(d.run, "i", 0)
    g1, g2 = d.enqueue(2)
    d.routed(d.members(g1), inst)
    d.routed(d.members(g2), inst)  # both in buffer 0 (B' = 2)
    assert d.buffers() == {0: (0, 2)}
    d.finish({d.members(g1)[0]: 1})
    d.reward_all()
    assert d.buffers() == {0: (1, 1)}  # ready, still holding g2's reservation
    assert d.p.abort_after_ready(d.run) == [g2]
    assert d.group(g2)[0::4] == ("aborted", "window_ready")
    assert d.sample(d.members(g2)[0])[4] == "window_ready"
    d.train(0)
    assert d.violations() == []


def test_publish_moves_or_drops_reservations_left_in_a_consumed_buffer(engine):
    d = Driver(engine, batch_size=1, buffer_capacity=2, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    g1, g2, g3 = d.enqueue(3)
    for g in (g1, g2, g3):
        d.routed(d.members(g), inst)  # buffer 1, buffer 1, buffer 0
    d.finish({d.members(g3)[0]: 1})
    d.reward_all()  # g3 fills buffer 0
    d.train(0)
    assert d.buffers()[0] == (1, 0)
    assert d.violations() == []


def test_dapo_filter_drops_uniform_groups_and_enqueues_a_replacement(engine):
    d = Driver(engine, batch_size=1, group_size=2, eta=1, dapo_filter=True)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    (outcome,) = d.complete(d.members(g), inst, reward=1.0)
    assert outcome.state == GroupState.FILTERED
    assert d.group(g)[0::4] == ("filtered", "filtered")
    assert d.buffers() == {1: (0, 0)}  # the reservation was released
    key, prompt, origin = d.one(
        "SELECT client_key, prompt_tokens, replacement_of FROM prompt_groups WHERE id = :g", g=outcome.replacement
    )
    assert (key, prompt, origin) == ("~r1:k0", [1, 2, 3], g)
    m = d.members(outcome.replacement)
    att = d.routed(m, inst)
    d.finish(att)
    tasks = d.p.claim_rewards(d.run, 10)
    (o,) = d.p.record_rewards(d.run, [(t.sample_id, t.reward_attempt, float(i)) for i, t in enumerate(tasks)])
    assert o.state == GroupState.OCCUPIED


def test_a_replacement_never_collides_with_a_client_key(engine):
    """The old replacement key `{key}~r` could already be a client's key: the insert was a
    no-op and the filtered prompt was lost (the replacement named the client's group)."""
    d = Driver(engine, batch_size=1, group_size=2, eta=1, dapo_filter=True)
    inst = d.p.register_instance(d.run, "i", 0)
    q, lookalike = d.p.enqueue(d.run, [Prompt("q", [1, 2]), Prompt("q~r", [9, 9])])
    (outcome,) = d.complete(d.members(q), inst, reward=1.0)
    assert outcome.state == GroupState.FILTERED and outcome.replacement not in (q, lookalike)
    assert d.one(
        "SELECT client_key, prompt_tokens, replacement_of FROM prompt_groups WHERE id = :g", g=outcome.replacement
    ) == ("~r1:q", [1, 2], q)
    with pytest.raises(InvalidInput, match="reserved for replacements"):
        d.p.enqueue(d.run, [Prompt("~r2:q", [1])])  # the namespace is the protocol's
    assert d.violations() == []


def test_abort_samples_and_groups(engine):
    d = Driver(engine, batch_size=1, group_size=2, samples_per_group=3, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    g1, g2 = d.enqueue(2)
    m = d.members(g1)
    d.routed(m, inst)
    assert d.p.abort_samples(d.run, [m[0]]) == [m[0]]  # 2 live members remain: group lives
    assert d.group(g1)[0] == "reserved"
    assert d.p.abort_samples(d.run, [m[1]]) == [m[1]]
    assert d.group(g1)[0::4] == ("aborted", "insufficient_members")
    assert d.sample(m[2])[4] == "insufficient_members"
    assert d.buffers()[1] == (0, 0)
    assert d.p.abort_group(d.run, g2) is True
    assert d.p.abort_group(d.run, g2) is False
    with pytest.raises(NotFound):
        d.p.abort_group(d.run, 424242)
    assert d.violations() == []


def test_consume_and_publish_refusals(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    assert d.p.consume(d.run, 0) is None  # not ready yet
    with pytest.raises(Conflict, match="not ready"):
        d.p.publish(d.run, 0, 1)
    (g,) = d.enqueue(1)
    d.complete(d.members(g), inst)
    first = d.p.consume(d.run, 0)
    second = d.p.consume(d.run, 0)  # a restarted trainer takes over the buffer
    assert second.consume_fence == first.consume_fence + 1
    with pytest.raises(Conflict, match="consume fence"):
        d.p.publish(d.run, 0, first.consume_fence)
    with pytest.raises(Conflict, match="version 0"):
        d.p.publish(d.run, 1, second.consume_fence)  # out of order
    assert d.p.publish(d.run, 0, second.consume_fence, size_bytes=10, checksum="abc", location="ps://1") == 1
    assert d.p.publish(d.run, 0, second.consume_fence) == 1  # a retry is a no-op
    assert d.rows("SELECT version, size_bytes, checksum FROM param_versions WHERE run_id = :r") == [(1, 10, "abc")]
    assert d.scalars("SELECT version FROM runs WHERE id = :r") == [1]


def test_request_id_replays_the_stored_outcome(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    r1 = d.p.route(d.run, [(s, inst)], request_id="route-1")
    r2 = d.p.route(d.run, [(s, inst)], request_id="route-1")
    assert r1 == r2 and r1[0].outcome == RouteOutcome.ROUTED
    rep = [Report(s, r1[0].attempt, 0, [1], [-1.0], instance_id=inst, route_token=r1[0].route_token)]
    assert d.p.report(d.run, rep, request_id="rep-1") == d.p.report(d.run, rep, request_id="rep-1") == 1
    assert d.scalars("SELECT count(*) FROM segments") == [1]
    with pytest.raises(Conflict, match="already used"):
        d.p.report(d.run, rep, request_id="route-1")


def test_segments_and_events_are_append_only(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    d.finish(d.routed(d.members(g), inst))
    for sql in ("UPDATE segments SET version = 5", "DELETE FROM segments", "DELETE FROM events"):
        with pytest.raises(DBAPIError, match="append-only"):
            with engine.begin() as c:
                c.execute(text(sql))


def test_audit_views_report_drops_and_staleness(engine):
    d = Driver(engine, batch_size=1, group_size=1, samples_per_group=2, eta=2)
    v0 = d.p.register_instance(d.run, "v0", 0)
    g1, g2 = d.enqueue(2)
    d.routed(d.members(g1), v0)
    d.complete(d.members(g2)[:1], v0)
    d.train(0)
    d.finish({d.members(g1)[0]: 1})
    d.reward_all()
    d.train(1)
    rows = d.rows("SELECT step, v_traj, staleness FROM trained_samples WHERE run_id = :r ORDER BY step")
    assert rows == [(0, 0, 0), (1, 0, 1)]
    assert sorted(d.scalars("SELECT reason FROM dropped_samples WHERE run_id = :r")) == ["surplus", "surplus"]
    assert d.violations() == []
    with engine.begin() as c:  # corrupt a counter: the view must notice
        c.execute(text("ALTER TABLE buffers DROP CONSTRAINT ck_buffers_consumed_full"))
        c.execute(text("UPDATE buffers SET occupied = 0 WHERE idx = 1"))
    assert {v[0] for v in d.violations()} == {"capacity"}
