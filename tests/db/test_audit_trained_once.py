"""Trained once: a trained group swapped with an untrained one keeps every counter of the buffer
accounting right, yet the protocol would hand the trained samples to the trainer a second
time. The audit names it (`trained_once`, against the append-only event log), and the consume
refuses the batch (`Corrupted`, a 409 over HTTP) instead of returning those samples; the same
run left alone audits empty after every operation and trains normally."""

from __future__ import annotations

import pytest
from audit_helpers import forge, found, state, trained_and_ready
from sqlalchemy import text

from staleflow_db.audit import violations
from staleflow_db.errors import Corrupted
from tests.api_helpers import in_process, token
from workers.client import StaleFlowClient

SWAP = (
    "UPDATE prompt_groups SET state = 'occupied', buffer = 1, finished_at = NULL WHERE id = :a",
    "UPDATE prompt_groups SET state = 'consumed', buffer = 0, finished_at = now() WHERE id = :c",
)


def _v2(engine, run: int) -> list:
    """audit_v2's checks alone (the view the complete audit extends)."""
    return state(engine, "SELECT invariant, subject FROM staleness_violations_v2 WHERE run_id = :r", r=run)


def _fence(engine, run: int, buffer: int) -> int:
    return state(engine, "SELECT consume_fence FROM buffers WHERE run_id = :r AND idx = :b", r=run, b=buffer)[0][0]


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
    assert s.d.p.publish(s.run, 1, batch.consume_fence) == 2
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


def test_the_consume_refuses_a_batch_holding_a_trained_group(engine):
    s = trained_and_ready(engine)
    forge(engine, *SWAP, a=s.a, c=s.c)
    fence = _fence(engine, s.run, 1)
    with pytest.raises(Corrupted) as refused:
        s.d.p.consume(s.run, 1)
    assert refused.value.code == "corrupted"
    (item,) = refused.value.items
    assert item == (
        s.a,
        f"group {s.a} in buffer 1 refused: already trained at step 0 (its Occupy placed it in buffer 0):"
        " its samples are not handed out again",
    )
    assert _fence(engine, s.run, 1) == fence  # refused: nothing changed, no fence taken
    with engine.connect() as c:
        assert c.execute(text("SELECT version FROM runs WHERE id = :r"), {"r": s.run}).scalar() == 1
    assert found(engine, s.run) == {("trained_once", f"group {s.a}"), ("trained_once", f"group {s.c}")}


def test_the_consume_refuses_a_group_placed_twice(engine):
    """A second Occupy of the ready group, in buffer 1 too: not placed once, refused as well."""
    s = trained_and_ready(engine)
    forge(
        engine,
        "INSERT INTO event_rows (run_id, kind, group_id, buffer, data) VALUES (:r, 'group_occupied', :c, 1, '{}')",
        r=s.run,
        c=s.c,
    )
    with pytest.raises(Corrupted, match=rf"group {s.c} in buffer 1 refused: its Occupy is in the event log 2 time"):
        s.d.p.consume(s.run, 1)
    assert found(engine, s.run) == {("trained_once", f"group {s.c}")}


def test_over_http_the_consume_answers_409_corrupted_and_the_audit_names_the_group(engine, db_url):
    s = trained_and_ready(engine)
    forge(engine, *SWAP, a=s.a, c=s.c)
    with in_process(db_url) as http:
        trainer = {"Authorization": f"Bearer {token(db_url, 'trainer', s.run)}"}
        r = http.post(f"/v1/runs/{s.run}/batches/1/consume?wait=0", headers=trainer)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "corrupted"
        assert [i["id"] for i in error["items"]] == [s.a]
        reason = error["items"][0]["reason"]
        assert "already trained at step 0" in reason and error["message"] == f"{s.a}: {reason}"
        observer = StaleFlowClient(http=http, token=token(db_url, "observer"), retry_for=None)
        rows = observer.http.get("/v1/audit/violations", params={"run_id": s.run}).json()["rows"]
        assert {(v["invariant"], v["subject"]) for v in rows} == {
            ("trained_once", f"group {s.a}"),
            ("trained_once", f"group {s.c}"),
        }
