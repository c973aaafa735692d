"""`staleflow audit` as a real process on a database holding a finished step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from protocol_helpers import Driver

from staleflow_db.audit import summary


def _run_audit(db_url, *args):
    env = {**os.environ, "STALEFLOW_DATABASE_URL": db_url}
    return subprocess.run(
        [sys.executable, "-m", "staleflow_cli.main", "audit", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_audit_summarises_steps_drops_and_violations(engine, db_url):
    d = Driver(engine, name="audited", batch_size=2, group_size=1, samples_per_group=2, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    groups = d.enqueue(2)
    d.complete([d.members(g)[0] for g in groups], inst, reward=0.5)
    d.train(0)
    data = summary(engine, d.run)
    assert data["steps"] == [{"step": 0, "samples": 2, "tokens": 4, "mean_reward": 0.5, "staleness": {0: 2}}]
    assert data["drops"] == [{"reason": "surplus", "samples": 2, "tokens": 0}]
    assert data["violations"] == []

    out = _run_audit(db_url, "audited")
    assert out.returncode == 0, out.stderr
    assert "staleness_violations: none" in out.stdout and "surplus" in out.stdout
    strict = _run_audit(db_url, "audited", "--strict")
    assert strict.returncode == 0, strict.stdout + strict.stderr
    parsed = json.loads(_run_audit(db_url, str(d.run), "--json").stdout)
    assert parsed["steps"][0]["staleness"] == {"0": 2}

    missing = _run_audit(db_url, "no-such-run")
    assert missing.returncode == 2 and "no-such-run" in missing.stderr

    with engine.begin() as c:  # break an invariant behind the protocol's back
        from sqlalchemy import text

        c.execute(text("UPDATE prompt_groups SET buffer = 5 WHERE run_id = :r AND state = 'consumed'"), {"r": d.run})
    reported = _run_audit(db_url, "audited")  # without --strict it only reports
    assert reported.returncode == 0 and "invariant violations" in reported.stdout
    broken = _run_audit(db_url, "audited", "--strict")
    assert broken.returncode == 1 and "invariant violations" in broken.stdout
    assert "bound: group" in broken.stdout


def test_strict_audit_fails_on_each_forged_database_and_passes_a_healthy_one(engine, db_url):
    """`staleflow audit RUN --strict` as a real process: 0 on the healthy run, 1 (printing every
    violation) once its state is forged, and the other run of the same database stays clean."""
    from audit_helpers import forge, healthy_run

    h = healthy_run(engine, name="forged")
    other = healthy_run(engine, name="clean")
    ok = _run_audit(db_url, "forged", "--strict")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "staleness_violations: none" in ok.stdout
    forge(engine, "UPDATE instances SET state = 'expired' WHERE id = :i", i=h.inst["i1"])
    bad = _run_audit(db_url, "forged", "--strict")
    assert bad.returncode == 1
    assert f"dead_instance: sample {h.m('g3', 1)}: running on instance {h.inst['i1']}, which is expired" in bad.stdout
    assert f"conservation: run {h.run}:" in bad.stdout
    as_json = _run_audit(db_url, str(h.run), "--strict", "--json")
    assert as_json.returncode == 1
    assert {v["invariant"] for v in json.loads(as_json.stdout)["violations"]} == {"dead_instance", "conservation"}
    assert _run_audit(db_url, "clean", "--strict").returncode == 0
    assert other.run != h.run


def test_strict_audit_names_a_trained_group_swapped_with_a_ready_one(engine, db_url):
    """The swap keeps every counter right (audit_v2's checks all pass); `--strict` still fails
    and prints the lineage rows, with the step the group already trained at."""
    from audit_helpers import forge, trained_and_ready

    s = trained_and_ready(engine, name="swapped")
    assert _run_audit(db_url, "swapped", "--strict").returncode == 0
    forge(
        engine,
        "UPDATE prompt_groups SET state = 'occupied', buffer = 1 WHERE id = :a",
        "UPDATE prompt_groups SET state = 'consumed', buffer = 0 WHERE id = :c",
        a=s.a,
        c=s.c,
    )
    bad = _run_audit(db_url, "swapped", "--strict")
    assert bad.returncode == 1
    assert "2 invariant violations" in bad.stdout
    assert f"trained_once: group {s.a}: occupied in buffer 1 at version 0;" in bad.stdout
    assert "which is consumed: trained at step 0" in bad.stdout
    assert f"trained_once: group {s.c}: consumed in buffer 0" in bad.stdout


def test_step_metrics_count_what_happened_between_publishes(engine):
    from staleflow_db.audit import step_metrics

    d = Driver(engine, name="steps", batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    g1, g2 = d.enqueue(2)
    d.complete(d.members(g1), inst, reward=0.25)
    d.train(0)
    (s,) = d.members(g2)
    att = d.routed([s], inst)
    from staleflow_db.types import Report
    from workers.wire.enums import SegmentKind

    d.p.report(d.run, [Report(s, att[s], 0, [1], [-1.0], SegmentKind.INTERRUPTED, **d.route_identity(s))])
    d.complete([s], inst)
    d.train(1)
    rows = step_metrics(engine, d.run)
    assert [(r["step"], r["samples"], r["routed"], r["interrupts"]) for r in rows] == [(0, 1, 1, 0), (1, 1, 2, 1)]
    assert rows[0]["mean_reward"] == 0.25 and rows[1]["staleness"] == {1: 1}
