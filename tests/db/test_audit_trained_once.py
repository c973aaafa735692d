"""Trained once: a trained group swapped with an untrained one keeps every counter of the buffer
accounting right, yet the protocol would hand the trained samples to the trainer a second
time. The audit names it (`trained_once`, against the append-only event log); the same run
left alone audits empty after every operation and trains normally."""

from __future__ import annotations

from audit_helpers import forge, found, state, trained_and_ready

from staleflow_db.audit import violations

SWAP = (
    "UPDATE prompt_groups SET state = 'occupied', buffer = 1, finished_at = NULL WHERE id = :a",
    "UPDATE prompt_groups SET state = 'consumed', buffer = 0, finished_at = now() WHERE id = :c",
)


def _v2(engine, run: int) -> list:
    """audit_v2's checks alone (the view the complete audit extends)."""
    return state(engine, "SELECT invariant, subject FROM staleness_violations_v2 WHERE run_id = :r", r=run)


def test_a_healthy_run_audits_empty_and_trains_each_group_once(engine):
    runs = []

    def clean():
        for run in runs:
            assert violations(engine, run) == []

    s = trained_and_ready(engine, check=clean)
    runs.append(s.run)
    clean()
    batch = s.d.p.consume(s.run, 1)
    assert [g.group_id for g in batch.groups] == [s.c]
    clean()
    assert s.d.p.publish(s.run, 1, batch.lease) == 2
    clean()
    assert state(
        engine, "SELECT id, state::text, buffer FROM prompt_groups WHERE run_id = :r ORDER BY id", r=s.run
    ) == [
        (s.a, "consumed", 0),
        (s.c, "consumed", 1),
    ]


def test_the_swap_keeps_the_accounting_and_is_named_by_trained_once_only(engine):
    s = trained_and_ready(engine)
    buffers = "SELECT idx, occupied, reserved, consumed_at IS NOT NULL FROM buffers WHERE run_id = :r ORDER BY idx"
    before = state(engine, buffers, r=s.run)
    forge(engine, *SWAP, a=s.a, c=s.c)
    assert state(engine, buffers, r=s.run) == before == [(0, 1, 0, True), (1, 1, 0, False)]
    assert _v2(engine, s.run) == []  # every check of audit_v2 passes
    assert found(engine, s.run) == {("trained_once", f"group {s.a}"), ("trained_once", f"group {s.c}")}
    details = {v["subject"]: v["detail"] for v in violations(engine, s.run)}
    assert details[f"group {s.a}"] == (
        "occupied in buffer 1 at version 0; the event log placed it 1 time(s),"
        " in buffer 0 at version 0, which is consumed: trained at step 0"
    )
    assert details[f"group {s.c}"] == (
        "consumed in buffer 0 at version 0; the event log placed it 1 time(s), in buffer 1 at version 0"
    )


def test_a_placed_group_put_back_to_be_placed_again(engine):
    """The ready group forged back to its reservation (counters moved along): an Occupy would
    place it a second time. Its first Occupy is still in the log."""
    s = trained_and_ready(engine)
    forge(
        engine,
        "UPDATE prompt_groups SET state = 'reserved', reserved_buffer = 1, buffer = NULL, group_version = NULL"
        " WHERE id = :c",
        "UPDATE buffers SET occupied = 0, reserved = 1 WHERE run_id = :r AND idx = 1",
        c=s.c,
        r=s.run,
    )
    assert _v2(engine, s.run) == []
    assert found(engine, s.run) == {("trained_once", f"group {s.c}")}
    (row,) = violations(engine, s.run)
    assert row["detail"] == "reserved; the event log placed it 1 time(s), in buffer 1 at version 0"
