"""Process chaos, CI-sized: bench/chaos.py on the sim engines (no torch, so processes restart
fast) — two API replicas, two coordinators, four rollout workers, a reward worker and the sim
trainer on a private embedded PostgreSQL; random SIGKILLs of every role, PostgreSQL stopped
once cleanly and once by SIGKILLing the postmaster; then drained and audited.

Nothing may be lost or duplicated, the audit must be empty, and no process may exit on its
own (a database or API outage is something to ride through, not to die of). The full run,
with the torch trainer and the parameter server in the kill set, is `python bench/chaos.py`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.embedded]


def test_chaos_loses_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("STALEFLOW_DATABASE_URL", None)  # its own private server, never the test one
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "chaos.py"),
            "--engine",
            "sim",
            "--seconds",
            "25",
            "--kills",
            "8",
            "--drain-steps",
            "2",
            "--drain-timeout",
            "60",
            "--report-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    tail = out.stdout[-6000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    m = re.fullmatch(r"chaos kills=(\d+) db_restarts=(\d+) lost=(\d+) duplicated=(\d+) violations=(\d+)", last)
    assert m, tail
    kills, db_restarts, lost, duplicated, violations = map(int, m.groups())
    (report,) = tmp_path.glob("chaos-*")
    result = json.loads((report / "chaos.json").read_text())
    assert (lost, duplicated, violations) == (0, 0, 0), tail
    assert result["check"]["problems"] == [], tail
    assert kills >= 8 and db_restarts == 2, tail
    assert {k for k, n in result["kills"].items() if n} >= {"api", "coordinator", "rollout", "reward", "trainer"}
    assert result["check"]["classes"].get("trained", 0) > 0
    exited = [f"{name} (rc {rc}):\n{log}" for name, rc, log in result["exited"]]
    assert not exited, "processes exited on their own:\n" + "\n\n".join(exited)
    assert (report / "logs" / "api-0.log").is_file() and (report / "logs" / "trainer.log").is_file()
