"""A publish keeps what the trainer reports of the step (its loss and metrics) with the version
(`param_versions.train_metrics`), read back by `param_versions` (the export's steps.jsonl); bad
metrics are refused with the reason and nothing is published."""

from __future__ import annotations

import pytest
from audit_helpers import trained_and_ready

from staleflow_db.errors import InvalidInput


def test_publish_keeps_the_steps_metrics_and_refuses_bad_ones(engine):
    s = trained_and_ready(engine, name="metrics")
    p = s.d.p
    batch = p.consume(s.run, 1)
    for bad, why in (
        ({"loss": float("nan")}, "'loss' must be a finite number"),
        ({"": 1.0}, "1..200 characters"),
        ({f"m{i}": 1.0 for i in range(65)}, "at most 64"),
    ):
        with pytest.raises(InvalidInput, match=why):
            p.publish(s.run, 1, batch.consume_fence, metrics=bad)
        assert p.reads.get_run(s.run).version == 1  # nothing published
    assert p.publish(s.run, 1, batch.consume_fence, 10, "c2", None, {"loss": -0.25, "clip_frac": 0.5}) == 2
    versions = {v.version: v for v in p.reads.param_versions(s.run, 10)}
    assert versions[2].train_metrics == {"loss": -0.25, "clip_frac": 0.5}
    assert versions[1].train_metrics is None  # step 0, published without metrics
