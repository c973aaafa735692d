"""The export writer without a database: its memory does not grow with the run (one page held
at a time), and a folder holding another export's kind is refused."""

from __future__ import annotations

import datetime as dt
import tracemalloc
from pathlib import Path

import pytest

from workers.export import export

T = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _source(total: int):
    def page(after: int, n: int) -> list[dict]:
        return [
            {
                "sample_id": i, "group_id": i // 4, "idx": i % 4, "client_key": f"k{i}", "prompt_tokens": [1] * 16,
                "state": "rewarded", "reason": None, "group_state": "consumed", "step": 1, "v_traj": 0,
                "staleness": 1, "reward": 1.0, "reward_metrics": {"acc": 1.0}, "reward_token_id": 3,
                "finish_reason": "eos", "n_tokens": 64, "response_tokens": [5] * 64, "logprobs": [-0.5] * 64,
                "loss_mask": [1] * 64, "token_versions": [0] * 64, "seg_lengths": [64], "seg_versions": [0],
                "seg_instances": [1], "enqueued_at": T, "first_segment_at": T, "last_segment_at": T,
                "group_finished_at": T, "updated_at": T,
            }
            for i in range(after + 1, min(after + n, total) + 1)
        ]  # fmt: skip

    return page


def _peak(total: int, out: Path, fmt: str) -> int:
    tracemalloc.start()
    try:
        manifest = export(_source(total), out, {}, fmt=fmt, page=100, chunk=1000)
        assert manifest.rows == total and len(manifest.files or []) == -(-total // 1000)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_memory_does_not_grow_with_the_run(tmp_path: Path, fmt: str) -> None:
    _peak(200, tmp_path / "warm", fmt)  # imports and first-use caches
    small, large = _peak(1_000, tmp_path / "small", fmt), _peak(10_000, tmp_path / "large", fmt)
    assert large < 1.5 * small, (small, large)


def test_a_folder_of_another_kind_of_export_is_refused(tmp_path: Path) -> None:
    export(_source(10), tmp_path, {}, fmt="jsonl")
    with pytest.raises(ValueError, match="use another folder"):
        export(_source(10), tmp_path, {}, fmt="parquet")
    with pytest.raises(ValueError, match="format must be"):
        export(_source(10), tmp_path / "x", {}, fmt="csv")
