"""Each invariant of the complete audit (`staleness_violations`), proven by forging the broken
state it must catch: a healthy run driven through the real protocol audits empty, then SQL
breaks exactly one thing behind the protocol's back (triggers and FK checks off, CHECK
constraints dropped where they would refuse it), and the audit must name exactly that
invariant and subject (plus, where listed, what the same corruption necessarily breaks too).
"""

from __future__ import annotations

import pytest
from audit_helpers import forge, found, healthy_run, state
from sqlalchemy.exc import IntegrityError

from staleflow_db.audit import summary, violations
from workers.wire.enums import DropReason


@pytest.fixture
def h(engine):
    run = healthy_run(engine)
    assert violations(engine, run.run) == []
    return run


def _g(h, key):
    return f"group {h.groups[key]}"


def _s(h, key, idx):
    return f"sample {h.m(key, idx)}"


def test_the_healthy_run_has_every_state_the_forgeries_start_from(engine, h):
    groups = dict(state(engine, "SELECT id, state::text FROM prompt_groups WHERE run_id = :r", r=h.run))
    assert [groups[h.groups[k]] for k in ("g1", "g2", "g3", "g4", "g5", "g5r", "g6")] == [
        "consumed",
        "consumed",
        "reserved",
        "occupied",
        "filtered",
        "queued",
        "queued",
    ]
    assert state(
        engine,
        "SELECT idx, occupied, reserved, consumed_at IS NOT NULL FROM buffers WHERE run_id = :r ORDER BY idx",
        r=h.run,
    ) == [(0, 1, 0, True), (1, 1, 0, True), (2, 1, 1, False), (3, 0, 0, False)]
    assert [
        r[0]
        for r in state(engine, "SELECT state::text FROM samples WHERE group_id = :g ORDER BY idx", g=h.groups["g3"])
    ] == ["queued", "running", "queued"]
    assert state(engine, "SELECT version FROM segments WHERE sample_id = :s ORDER BY seq", s=h.m("g2", 0)) == [
        (0,),
        (0,),
        (1,),
    ]
    assert summary(engine, h.run)["steps"][1]["staleness"] == {1: 2}


# ---- bound ------------------------------------------------------------------------------------


def test_bound_members_too_stale_for_their_occupied_group(engine, h):
    """Group g4 waits in buffer 2 (not trained yet); with eta 1 members of version 0 are too stale."""
    forge(
        engine,
        "UPDATE samples SET v_traj = 0 WHERE group_id = :g AND state = 'rewarded'",
        "UPDATE prompt_groups SET group_version = 0, min_version = 0 WHERE id = :g",
        g=h.groups["g4"],
    )
    assert found(engine, h.run) == {("bound", _g(h, "g4")), ("bound", _s(h, "g4", 0)), ("bound", _s(h, "g4", 1))}


def test_bound_a_member_trained_before_its_model_existed(engine, h):
    """A member of g1 (trained at step 0) claiming V_traj 1 and a segment at version 1."""
    sid = h.m("g1", 0)
    forge(
        engine,
        "UPDATE samples SET v_traj = 1, last_version = 1 WHERE id = :s",
        "UPDATE segments SET version = 1 WHERE sample_id = :s",
        s=sid,
    )
    assert found(engine, h.run) == {("bound", f"sample {sid}"), ("segment_version", f"sample {sid}")}


def test_group_version_is_the_least_member_version(engine, h):
    forge(engine, "UPDATE prompt_groups SET group_version = 1 WHERE id = :g", g=h.groups["g4"])  # members are at 2
    assert found(engine, h.run) == {("group_version", _g(h, "g4"))}


# ---- buffers ----------------------------------------------------------------------------------


def test_capacity_counter_disagrees_with_the_entries(engine, h):
    forge(engine, "UPDATE buffers SET reserved = 1 WHERE run_id = :r AND idx = 3", r=h.run)
    assert found(engine, h.run) == {("capacity", "buffer 3")}


def test_capacity_over_the_buffer_capacity(engine, h):
    forge(
        engine,
        "UPDATE buffers SET capacity = 1 WHERE run_id = :r AND idx = 2",
        r=h.run,
        drop_checks=(("buffers", "ck_buffers_capacity"),),
    )
    assert found(engine, h.run) == {("capacity", "buffer 2")}


def test_capacity_more_occupied_entries_than_b(engine, h):
    """g3 (reserved in buffer 2 beside g4) forged occupied there too: two groups where B = 1."""
    forge(
        engine,
        "UPDATE prompt_groups SET state = 'occupied', reserved_buffer = NULL, buffer = 2, group_version = 1"
        " WHERE id = :g",
        "UPDATE samples SET state = 'rewarded', reward = 1, instance_id = NULL WHERE group_id = :g AND idx < 2",
        "UPDATE samples SET state = 'aborted', reason = 'surplus' WHERE group_id = :g AND idx = 2",
        "UPDATE buffers SET occupied = 2, reserved = 0 WHERE run_id = :r AND idx = 2",
        "INSERT INTO event_rows (run_id, kind, group_id, buffer, data)"
        " VALUES (:r, 'group_occupied', :g, 2, '{\"version\": 1}')",
        g=h.groups["g3"],
        r=h.run,
        drop_checks=(("buffers", "ck_buffers_batch"),),
    )
    assert found(engine, h.run) == {("capacity", "buffer 2")}


def test_entry_in_a_buffer_that_does_not_exist(engine, h):
    forge(engine, "DELETE FROM buffers WHERE run_id = :r AND idx = 2", r=h.run)
    assert found(engine, h.run) == {("entry_buffer", _g(h, "g3")), ("entry_buffer", _g(h, "g4"))}


def test_entry_reserved_in_a_consumed_buffer(engine, h):
    forge(
        engine,
        "UPDATE prompt_groups SET reserved_buffer = 1 WHERE id = :g",
        "UPDATE buffers SET reserved = reserved - 1 WHERE run_id = :r AND idx = 2",
        "UPDATE buffers SET reserved = reserved + 1 WHERE run_id = :r AND idx = 1",
        g=h.groups["g3"],
        r=h.run,
    )
    assert found(engine, h.run) == {("entry_buffer", _g(h, "g3"))}


def test_reservation_outside_a_members_window(engine, h):
    """g3 is reserved in buffer 2; a running member of version 0 could never join it (0 + 1 < 2)."""
    forge(
        engine,
        "UPDATE samples SET v_traj = 0 WHERE id = :s",
        "UPDATE prompt_groups SET min_version = 0 WHERE id = :g",
        s=h.m("g3", 1),
        g=h.groups["g3"],
    )
    assert found(engine, h.run) == {("reservation_window", _s(h, "g3", 1))}


def test_consumed_buffer_trained_on_fewer_than_b_groups(engine, h):
    forge(
        engine,
        "UPDATE runs SET batch_size = 2 WHERE id = :r",
        "UPDATE buffers SET batch_size = 2 WHERE run_id = :r",
        r=h.run,
        drop_checks=(("buffers", "ck_buffers_consumed_full"),),
    )
    assert found(engine, h.run) == {("consumed_batch", "buffer 0"), ("consumed_batch", "buffer 1")}


def test_occupied_group_never_trained_though_its_buffer_was_consumed(engine, h):
    forge(engine, "UPDATE prompt_groups SET state = 'occupied' WHERE id = :g", g=h.groups["g2"])
    assert found(engine, h.run) == {("trained_state", _g(h, "g2"))}


def test_group_consumed_before_its_buffer(engine, h):
    forge(engine, "UPDATE prompt_groups SET state = 'consumed' WHERE id = :g", g=h.groups["g4"])
    assert found(engine, h.run) == {("trained_state", _g(h, "g4"))}


def test_horizon_no_buffer_beyond_version_plus_eta(engine, h):
    forge(engine, "INSERT INTO buffers (run_id, idx, batch_size, capacity) VALUES (:r, 4, 1, 2)", r=h.run)
    assert found(engine, h.run) == {("horizon", "buffer 4")}


# ---- contiguity -------------------------------------------------------------------------------


def test_contiguity_a_version_published_twice(engine, h):
    forge(
        engine,
        "INSERT INTO event_rows (run_id, kind, buffer, data) VALUES (:r, 'published', 0, '{\"version\": 1}')",
        r=h.run,
    )
    assert found(engine, h.run) == {("contiguity", "buffer 0")}


def test_contiguity_a_published_version_with_no_consumed_buffer(engine, h):
    forge(engine, "INSERT INTO param_versions (run_id, version) VALUES (:r, 3)", r=h.run)  # buffer 2 is not consumed
    assert found(engine, h.run) == {("contiguity", "buffer 2")}
    forge(
        engine,
        "INSERT INTO param_versions (run_id, version) VALUES (:r, 8)",
        "INSERT INTO event_rows (run_id, kind, buffer) VALUES (:r, 'published', 9)",
        r=h.run,
    )  # no such buffers
    assert found(engine, h.run) == {("contiguity", "buffer 2"), ("contiguity", "version 8"), ("contiguity", "buffer 9")}


def test_contiguity_run_version_disagrees_with_consumed_buffers(engine, h):
    """Buffer 2 marked consumed without a publish: the run is still at version 2."""
    forge(engine, "UPDATE buffers SET consumed_at = now() WHERE run_id = :r AND idx = 2", r=h.run)
    assert found(engine, h.run) == {
        ("contiguity", f"run {h.run}"),
        ("contiguity", "buffer 2"),  # consumed, never published
        ("trained_state", _g(h, "g4")),
        ("entry_buffer", _g(h, "g3")),  # what its groups then are
    }


def test_contiguity_a_consumed_buffer_missing_in_the_sequence(engine, h):
    forge(
        engine,
        "UPDATE buffers SET consumed_at = NULL WHERE run_id = :r AND idx = 0",
        "UPDATE prompt_groups SET state = 'occupied' WHERE run_id = :r AND buffer = 0",
        r=h.run,
        drop_checks=(),
    )
    assert found(engine, h.run) == {("contiguity", f"run {h.run}"), ("contiguity", "buffer 0")}


# ---- segments and tokens ----------------------------------------------------------------------


def test_segment_versions_decrease(engine, h):
    sid = h.m("g2", 0)  # segments at versions 0, 0, 1
    forge(engine, "UPDATE segments SET version = 1 WHERE sample_id = :s AND seq = 0", s=sid)
    assert found(engine, h.run) == {("segment_version", f"sample {sid}")}


def test_segment_generated_by_a_model_newer_than_the_step_that_trained_it(engine, h):
    sid = h.m("g1", 1)  # trained at step 0; version 1 exists
    forge(
        engine,
        "UPDATE segments SET version = 1 WHERE sample_id = :s",
        "UPDATE samples SET last_version = 1 WHERE id = :s",
        s=sid,
    )
    assert found(engine, h.run) == {("segment_version", f"sample {sid}")}


def test_segment_older_than_v_traj_or_newer_than_the_run(engine, h):
    older, newer = h.m("g4", 0), h.m("g3", 0)  # V_traj 2 (occupied) and 1 (queued with tokens)
    forge(
        engine,
        "UPDATE segments SET version = 1 WHERE sample_id = :a AND seq = 0",
        "UPDATE segments SET version = 3 WHERE sample_id = :b",
        "UPDATE samples SET last_version = 3 WHERE id = :b",
        a=older,
        b=newer,
    )
    assert found(engine, h.run) == {("segment_version", f"sample {older}"), ("segment_version", f"sample {newer}")}


def test_tokens_count_disagrees_with_the_segments(engine, h):
    sid = h.m("g1", 0)
    forge(engine, "UPDATE samples SET n_tokens = n_tokens + 1 WHERE id = :s", s=sid)
    assert found(engine, h.run) == {("tokens", f"sample {sid}")}


def test_tokens_a_segment_lost_from_the_concatenation(engine, h):
    """The count still agrees, but segment 0 of three is gone: the concatenation is not whole."""
    sid = h.m("g2", 0)
    forge(
        engine,
        "UPDATE samples SET n_tokens = n_tokens - 2, n_segments = n_segments - 1 WHERE id = :s",
        "DELETE FROM segments WHERE sample_id = :s AND seq = 0",
        s=sid,
    )
    assert found(engine, h.run) == {("tokens", f"sample {sid}")}


# ---- groups and members -----------------------------------------------------------------------


def test_trained_group_without_n_trained_members(engine, h):
    forge(engine, "UPDATE samples SET state = 'aborted', reason = 'user' WHERE id = :s", s=h.m("g1", 1))
    assert found(engine, h.run) == {("trained_members", _g(h, "g1"))}


def test_live_member_left_in_a_trained_group(engine, h):
    forge(engine, "UPDATE samples SET state = 'queued', reason = NULL WHERE id = :s", s=h.m("g1", 2))
    assert found(engine, h.run) == {("live_member", _s(h, "g1", 2)), ("conservation", f"run {h.run}")}


def test_live_member_left_in_a_dropped_group(engine, h):
    forge(engine, "UPDATE samples SET state = 'rewarded', reason = NULL WHERE id = :s", s=h.m("g5", 0))
    assert found(engine, h.run) == {("live_member", _s(h, "g5", 0)), ("conservation", f"run {h.run}")}


def test_routed_member_of_a_group_that_holds_no_reservation(engine, h):
    forge(
        engine,
        "UPDATE samples SET state = 'running', v_traj = 2, instance_id = :i, attempt = 1 WHERE id = :s",
        "INSERT INTO event_rows (run_id, kind, sample_id, instance_id) VALUES (:r, 'sample_routed', :s, :i)",
        "UPDATE prompt_groups SET min_version = 2 WHERE id = :g",
        r=h.run,
        g=h.groups["g6"],
        s=h.m("g6", 0),
        i=h.inst["i2"],
    )
    assert found(engine, h.run) == {("unreserved_member", _s(h, "g6", 0))}


def test_sample_running_on_a_dead_instance(engine, h):
    sid = h.m("g3", 1)  # running on i1
    forge(engine, "UPDATE instances SET lease_expires_at = now() - interval '1 minute' WHERE id = :i", i=h.inst["i1"])
    assert found(engine, h.run) == set()  # lapsed but not yet fenced by a sweep: still active, not an error
    forge(engine, "UPDATE instances SET state = 'expired' WHERE id = :i", i=h.inst["i1"])
    assert found(engine, h.run) == {("dead_instance", f"sample {sid}"), ("conservation", f"run {h.run}")}
    (row,) = [v for v in violations(engine, h.run) if v["invariant"] == "conservation"]
    assert f"1 lost (first: {sid})" in row["detail"]


def test_drops_carry_a_reason(engine, h):
    forge(
        engine,
        "UPDATE samples SET reason = NULL WHERE id = :s",
        "UPDATE prompt_groups SET reason = ' ' WHERE id = :g",
        s=h.m("g1", 2),
        g=h.groups["g5"],
        drop_checks=(("samples", "ck_samples_abort_has_reason"),),
    )
    assert found(engine, h.run) == {("drop_reason", _s(h, "g1", 2)), ("drop_reason", _g(h, "g5"))}


# ---- conservation -----------------------------------------------------------------------------


def test_conservation_a_sample_row_lost(engine, h):
    forge(engine, "DELETE FROM samples WHERE id = :s", s=h.m("g6", 2))
    assert found(engine, h.run) == {("conservation", _g(h, "g6"))}


def test_conservation_a_live_group_that_can_no_longer_reach_n(engine, h):
    forge(
        engine,
        "UPDATE samples SET state = 'aborted', reason = :why WHERE id = ANY(:s)",
        s=[h.m("g3", 0), h.m("g3", 2)],
        why=DropReason.USER.value,
    )  # one live member left, N = 2
    assert found(engine, h.run) == {("conservation", _g(h, "g3"))}


def test_conservation_filtered_without_a_replacement(engine, h):
    forge(engine, "UPDATE prompt_groups SET replacement_of = NULL WHERE id = :g", g=h.groups["g5r"])
    assert found(engine, h.run) == {("conservation", _g(h, "g5"))}


def test_conservation_an_enqueued_group_lost(engine, h):
    forge(
        engine, "DELETE FROM samples WHERE group_id = :g", "DELETE FROM prompt_groups WHERE id = :g", g=h.groups["g6"]
    )
    assert found(engine, h.run) == {("conservation", _g(h, "g6"))}


def test_forgery_in_one_run_does_not_leak_into_another(engine, h):
    other = healthy_run(engine, name="other")
    forge(engine, "UPDATE samples SET n_tokens = 99 WHERE id = :s", s=h.m("g1", 0))
    assert found(engine, other.run) == set()
    assert found(engine, h.run) == {("tokens", _s(h, "g1", 0))}


# ---- lineage: segments against their routes, counters against the segments, group version -----


def test_segment_lineage_attempts_out_of_order(engine, h):
    """g2 m0: segments 0 and 1 of attempt 1 (on i0), segment 2 of attempt 2 (resumed on i1).
    Segment 0 forged to attempt 2 from i1, the instance of route 2: only the order is wrong."""
    sid = h.m("g2", 0)
    assert state(engine, "SELECT attempt, instance_id FROM segments WHERE sample_id = :s ORDER BY seq", s=sid) == [
        (1, h.inst["i0"]),
        (1, h.inst["i0"]),
        (2, h.inst["i1"]),
    ]
    forge(
        engine,
        "UPDATE segments SET attempt = 2, instance_id = :i WHERE sample_id = :s AND seq = 0",
        s=sid,
        i=h.inst["i1"],
    )
    assert found(engine, h.run) == {("segment_lineage", f"sample {sid}")}
    (row,) = violations(engine, h.run)
    assert (
        f"segments in seq order at attempts {{2,1,2}} from instances {{{h.inst['i1']},{h.inst['i0']},{h.inst['i1']}}}"
        in row["detail"]
    )


def test_segment_lineage_a_segment_from_another_instance_than_its_route(engine, h):
    """g2 m0's last segment (attempt 2, routed to i1) forged as i2's."""
    sid = h.m("g2", 0)
    forge(engine, "UPDATE segments SET instance_id = :i WHERE sample_id = :s AND seq = 2", s=sid, i=h.inst["i2"])
    assert found(engine, h.run) == {("segment_lineage", f"sample {sid}")}
    (row,) = violations(engine, h.run)
    assert f"after 2 routes (to instances {{{h.inst['i0']},{h.inst['i1']}}})" in row["detail"]


def test_segment_lineage_a_segment_of_an_attempt_never_routed(engine, h):
    sid = h.m("g4", 0)  # one route, one segment of attempt 1
    forge(engine, "UPDATE segments SET attempt = 2 WHERE sample_id = :s", s=sid)
    assert found(engine, h.run) == {("segment_lineage", f"sample {sid}")}


def test_segment_lineage_an_attempt_counter_behind_the_routes(engine, h):
    """g3 m1 runs on i1 at attempt 1; set back to 0, a stale route's token would be current."""
    sid = h.m("g3", 1)
    forge(engine, "UPDATE samples SET attempt = 0 WHERE id = :s", s=sid)
    assert found(engine, h.run) == {("segment_lineage", f"sample {sid}")}


def test_segment_count_drifts_from_the_segments_and_the_sample_can_never_finish(engine, h):
    """g3 m1 (running on i1, one segment): its counter says none, so its next report writes seq 0
    again and is refused (the primary key); the audit names the counter."""
    sid = h.m("g3", 1)
    forge(engine, "UPDATE samples SET n_segments = 0 WHERE id = :s", s=sid)
    assert found(engine, h.run) == {("segment_count", f"sample {sid}")}
    with pytest.raises(IntegrityError, match="segments"):
        h.d.finish({sid: h.d.sample(sid)[2]}, version=1)
    assert found(engine, h.run) == {("segment_count", f"sample {sid}")}  # nothing changed


def test_segment_count_last_version_disagrees_with_the_last_segment(engine, h):
    sid = h.m("g2", 0)  # last segment at version 1
    forge(engine, "UPDATE samples SET last_version = 0 WHERE id = :s", s=sid)
    assert found(engine, h.run) == {("segment_count", f"sample {sid}")}


def test_group_version_above_a_live_members_version(engine, h):
    """g3 (reserved in buffer 2) has live members of V_traj 1: m0 queued with tokens, m1 running."""
    assert state(engine, "SELECT min_version FROM prompt_groups WHERE id = :g", g=h.groups["g3"]) == [(1,)]
    forge(engine, "UPDATE prompt_groups SET min_version = 2 WHERE id = :g", g=h.groups["g3"])
    assert found(engine, h.run) == {("group_version", _g(h, "g3"))}
    (row,) = violations(engine, h.run)
    assert (
        row["detail"]
        == f"reserved group recorded at version 2 (as of its latest route), but its live member sample {h.m('g3', 0)} has V_traj 1"
    )


def test_group_version_missing_while_a_member_pins_one(engine, h):
    forge(engine, "UPDATE prompt_groups SET min_version = NULL WHERE id = :g", g=h.groups["g3"])
    assert found(engine, h.run) == {("group_version", _g(h, "g3"))}
