"""The run lifecycle in the data layer: an enqueue that read the run before a cancel committed
(it takes no run lock) may add groups after it; a cancel again aborts them, and the audit
stays green."""

from __future__ import annotations

import pytest
from protocol_helpers import Driver

from staleflow_db.errors import RunNotActive
from staleflow_db.protocol import Prompt
from staleflow_db.protocol.core import enqueue_prompts, load_run
from workers.wire.enums import RunState


def test_cancel_again_aborts_what_a_racing_enqueue_added(engine):
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    with engine.begin() as conn:
        before = load_run(conn, d.run, lock=False)  # the racing enqueue's read: still active
    assert d.p.set_state(d.run, RunState.CANCELLED, "stop") == []
    with pytest.raises(RunNotActive, match="is cancelled: enqueue refused"):
        d.p.enqueue(d.run, [Prompt("late", [1])])
    with engine.begin() as conn:  # the racing enqueue's write, after the cancel
        (late,) = enqueue_prompts(conn, before, [Prompt("late", [1])])
    assert d.p.set_state(d.run, RunState.CANCELLED) == [late]
    assert d.scalars("SELECT reason FROM prompt_groups WHERE run_id = :r") == ["run_cancelled"]
    assert d.scalars("SELECT state_reason FROM runs WHERE id = :r") == ["stop"]  # the first reason stays
    assert d.violations() == []
