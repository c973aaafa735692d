"""bench/capacity.py --quick: Locust-driven simulated instances, reward workers and a trainer
against a real API replica on a private embedded PostgreSQL, the instances on their own and as
nodes of four (one sync per flush, one long-poll), and those nodes through a local PgBouncer.
Every call must succeed, samples must finish, pulls must reach the instances, pgbench must run
beside them on the same server, and the last line must have its shape; the figures themselves
depend on the machine and are not asserted."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.pooler import pgbouncer_binary

REPO = Path(__file__).resolve().parents[2]

# found, not imported: importing locust monkey-patches this process with gevent
pytestmark = [
    pytest.mark.slow,
    pytest.mark.embedded,
    pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust (the dev extra) is not installed"),
]


@pytest.mark.parametrize(("per_node", "pooler"), [(1, False), (4, False), (4, True)])
def test_quick_capacity_run_has_no_errors(tmp_path, per_node, pooler):
    if pooler and pgbouncer_binary() is None:
        pytest.skip("pgbouncer is not installed (apt-get install -y pgbouncer)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("STALEFLOW_DATABASE_URL", None)  # its own private server, never the test one
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "capacity.py"), "--quick", "--report-dir", str(tmp_path)]
        + ["--instances-per-node", str(per_node)]
        + (["--pgbouncer", "4"] if pooler else []),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, tail
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(
        r"capacity instances=\d+ calls_per_s=\d+ p99_ms=\d+ db_us_per_call=\d+ api_us_per_call=\d+", lines[-1]
    ), tail
    steps = [ln.split() for ln in lines if re.match(r"\s+\d+\s+\d+\s+[\d.]+\s", ln)]
    assert steps, tail
    for row in steps:  # instances calls/s calls/sample inst/s p99 worst pull db api load ms/sample conns errors ok
        assert int(row[0]) > 0 and float(row[2]) > 0 and float(row[10]) > 0 and row[12] == "0", tail
    assert re.search(r"command delivery p99 \d+ ms \(\d+ pulls\)", out.stdout), tail
    # the baseline on the same server: each step's calls/s against pgbench -N's TPS
    assert re.search(r"pgbench -N on the same server \(.*\): [\d,]+ TPS at \d+ \+ \d+ us", out.stdout), tail
    assert "error:" not in out.stdout, tail
    if pooler:  # every call through the pooler, its LISTEN straight to the server
        assert "replicas through PgBouncer" in out.stdout, tail
        assert re.search(r"CPU per call of the PgBouncer between the replicas and the server: \d+ us", out.stdout), tail
