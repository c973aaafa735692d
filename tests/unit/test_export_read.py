"""An export read back as the trainer's batches, without a database: a step's groups in id order
and each group's samples in index order (as the consume endpoint hands them out), whatever the
order of the sample ids; Parquet and JSON lines alike; a missing or incomplete step refused."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from workers.export import export
from workers.export_read import Export, ExportError

T = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
# (sample id, group, idx, step): group 7 was enqueued before group 3 but trained after it
ROWS = [(1, 7, 1, 1), (2, 7, 0, 1), (3, 3, 0, 0), (4, 3, 1, 0), (5, 9, 0, 0), (6, 9, 1, 0), (7, 8, 0, 1), (8, 8, 1, 1)]


def _row(sid: int, group: int, idx: int, step: int | None) -> dict:
    n = 2 + sid % 3
    return {
        "sample_id": sid, "group_id": group, "idx": idx, "client_key": f"g{group}", "prompt_tokens": [group, 1],
        "state": "rewarded", "reason": None, "group_state": "consumed", "step": step, "v_traj": 0,
        "staleness": step, "reward": float(sid % 2), "reward_metrics": None, "reward_token_id": None,
        "finish_reason": "length", "n_tokens": n, "response_tokens": [sid] * n, "logprobs": [-0.25 * sid] * n,
        "loss_mask": [1] * (n - 1) + [0], "token_versions": [0] * (n - 1) + [None], "seg_lengths": [n - 1, 1],
        "seg_versions": [0, None], "seg_instances": [1, 1], "enqueued_at": T, "first_segment_at": T,
        "last_segment_at": T, "group_finished_at": T, "updated_at": T,
    }  # fmt: skip


def _write(out: Path, fmt: str, rows=ROWS, batch_size: int = 2) -> Export:
    data = [_row(*r) for r in rows]
    export(
        lambda after, n: [r for r in data if r["sample_id"] > after][:n],
        out,
        {"id": 5, "config": {"batch_size": batch_size}},
        fmt=fmt,
        chunk=3,
    )
    return Export(out)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_step_is_rebuilt_as_it_was_consumed(tmp_path: Path, fmt: str) -> None:
    ex = _write(tmp_path, fmt)
    assert ex.run_id == 5 and ex.steps() == [0, 1]
    b = ex.batch(1)
    assert (b.run_id, b.version) == (5, 1)
    assert [g.group_id for g in b.groups] == [7, 8]
    assert [[s.sample_id for s in g.samples] for g in b.groups] == [[2, 1], [7, 8]]
    s = b.groups[0].samples[0]
    assert s.tokens == [2] * 4 and s.logprobs == [-0.5] * 4 and s.loss_mask == [1, 1, 1, 0]
    assert [(x.n_tokens, x.version, x.generated) for x in s.segments] == [(3, 0, True), (1, None, False)]
    assert b.groups[0].prompt_tokens == [7, 1]
    assert [bb.version for bb in ex.batches()] == [0, 1]
    assert ex.batch(0).model_dump() == next(ex.batches()).model_dump()


def test_missing_and_incomplete_steps_are_refused(tmp_path: Path) -> None:
    ex = _write(tmp_path / "a", "parquet")
    with pytest.raises(ExportError, match="holds steps 0..1, not step 2"):
        ex.batch(2)
    part = _write(tmp_path / "b", "jsonl", rows=ROWS[:7])  # group 8 lost a sample: still a group
    assert [len(g.samples) for g in part.batch(1).groups] == [2, 1]
    short = _write(tmp_path / "c", "jsonl", rows=ROWS[:6])  # step 1 has one group of two
    with pytest.raises(ExportError, match="1 group\\(s\\) of step 1, the run trains 2"):
        short.batch(1)
    with pytest.raises(ExportError, match="not an export"):
        Export(tmp_path)
