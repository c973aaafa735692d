"""A small `staleflow demo` as a new user runs it: every process real, the audit clean, a report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_small_demo_trains_publishes_and_reports(db_url, tmp_path):
    env = {**os.environ, "STALEFLOW_DATABASE_URL": db_url}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "staleflow_cli.main",
            "demo",
            "--steps",
            "3",
            "--instances",
            "2",
            "--batch-size",
            "4",
            "--group-size",
            "2",
            "--report-dir",
            str(tmp_path),
            "--timeout",
            "240",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "staleness_violations: 0" in out.stdout
    (folder,) = tmp_path.iterdir()
    report = json.loads((folder / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert all(s["samples"] == 8 for s in report["steps"])  # B * N per step
    assert report["audit"]["violations"] == []
    assert (folder / "demo.png").stat().st_size > 10_000
    assert {p.name for p in (folder / "logs").iterdir()} >= {"api.log", "trainer.log", "coordinator.log", "ps.log"}
