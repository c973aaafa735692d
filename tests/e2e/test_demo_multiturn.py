"""A short `staleflow demo --task multiturn`: every role a real process, trajectories of
several turns whose environment answers between them; each turn recorded with the version
that generated it, observations with loss mask 0 and no version, trajectories moving between
instances between turns, and the complete audit (per-turn checks included) clean."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from sqlalchemy import text

pytest.importorskip("torch")


@pytest.mark.slow  # a whole demo run, every role as a process
def test_multiturn_demo_trains_on_turns_and_audits_clean(db_url, engine, tmp_path):
    env = {**os.environ, "STALEFLOW_DATABASE_URL": db_url}
    args = ["--task", "multiturn", "--steps", "4", "--instances", "2", "--batch-size", "4", "--group-size", "4"]
    proc = subprocess.run(
        [sys.executable, "-m", "staleflow_cli.main", "demo", *args, "--report-dir", str(tmp_path), "--timeout", "300"],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    last = proc.stdout.strip().splitlines()[-1]
    found = re.fullmatch(
        r"demo task=multiturn steps=4 turns=(\d\.\d\d) accuracy=[01]\.\d{3} reward=[01]\.\d{3} "
        r"max_reward=1\.000 violations=0",
        last,
    )
    assert found, last
    assert float(found.group(1)) > 1.5  # the environment answered: trajectories of several turns
    with engine.connect() as c:
        seg = c.execute(
            text(
                "SELECT count(*) FILTER (WHERE generated), count(*) FILTER (WHERE NOT generated),"
                " count(*) FILTER (WHERE NOT generated AND (version IS NOT NULL OR"
                "   ltrim(logprobs, '\\x00'::bytea) <> ''::bytea)) FROM segments"  # packed float32 0.0: zero bytes
            )
        ).one()
        # trajectories whose turns were generated on more than one instance (moved between turns)
        moved = c.execute(
            text(
                "SELECT count(*) FROM (SELECT sample_id FROM segments WHERE generated GROUP BY sample_id"
                " HAVING count(DISTINCT instance_id) > 1) x"
            )
        ).scalar()
    assert seg[0] > 0 and seg[1] > 0 and seg[2] == 0, seg
    assert moved > 0
