"""The lineage of a multi-turn trajectory (generated turns and observations, each generated
turn's version and published checksum), and the complete audit catching a broken chain:
a trained token whose version has no published parameters, forged."""

from __future__ import annotations

from audit_helpers import forge, found

from staleflow_db.protocol import Protocol
from tests.db.test_turns import turns  # noqa: F401  (the fixture: a trajectory of turns trained at step 1)


def test_lineage_of_a_trajectory_of_turns(turns):  # noqa: F811
    d, a = turns
    rows = [r for r in Protocol(d.engine).reads.lineage(d.run, 1) if r["sample_id"] == a]
    assert [(r["seq"], r["generated"], r["version"]) for r in rows] == [
        (0, True, 0),
        (1, False, None),
        (2, True, 1),
        (3, True, 1),
    ]
    assert [r["published_by_step"] for r in rows] == [None, None, 0, 0]
    assert [r["instance_name"] for r in rows] == ["i0", "i0", "i1", "i1"]
    assert {r["reward"] for r in rows} == {1.0} and {r["scorer_token_id"] for r in rows} == {None}  # in-process
    assert Protocol(d.engine).reads.lineage(d.run, 1, a) == rows


def test_audit_catches_a_trained_version_without_published_parameters(turns):  # noqa: F811
    d, a = turns
    assert d.violations() == []
    # the generated turn at version 1 loses its publication: the chain is broken
    forge(d.engine, "DELETE FROM param_versions WHERE run_id = :r AND version = 1", r=d.run)
    assert ("contiguity", "buffer 0") in found(d.engine, d.run)


def test_audit_catches_a_generated_turn_above_its_step(turns):  # noqa: F811
    d, a = turns
    # a turn after the observation claims a version no published step had made before step 1
    forge(d.engine, "UPDATE segments SET version = 2 WHERE sample_id = :s AND seq = 3", s=a)
    kinds = found(d.engine, d.run)
    assert ("segment_version", f"sample {a}") in kinds
