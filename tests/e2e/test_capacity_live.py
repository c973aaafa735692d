"""A reported capacity is respected end to end: a real API server, a real coordinator process
and a real rollout worker process whose engine reports `max_running` 2. The database's own
record (route events, segments) shows the coordinator never had more than two samples in
flight on the instance, and that it did use both slots."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from api_helpers import REPO, ApiServer, token
from sqlalchemy import create_engine, text

WAIT_S = 120  # guards against a hang, never a timing assertion
CAP = 2
GROUPS, N = 6, 2

# Per route R of the run, in log order (id, ord: the routes of one statement share a folded row):
# the samples routed to R's instance before R whose stretch had not
# ended when R's transaction began (no segment of that attempt yet, or its last one written by
# a transaction that began after R's). A report transaction that began before R's is counted
# as ended; one that began after it could not have been visible to the cycle that decided R,
# which counted the sample as running: so these counts bound what the coordinator saw from
# above, and the stretches really in flight too.
IN_FLIGHT = """
WITH r AS (SELECT id, ord, at, sample_id, instance_id,
             row_number() OVER (PARTITION BY sample_id ORDER BY id, ord) AS attempt
           FROM events WHERE run_id = :run AND kind = 'sample_routed'),
e AS (SELECT sample_id, attempt, max(created_at) AS ended FROM segments WHERE run_id = :run
      GROUP BY sample_id, attempt)
SELECT r.id, r.instance_id,
  (SELECT count(*) FROM r p LEFT JOIN e ON e.sample_id = p.sample_id AND e.attempt = p.attempt
   WHERE p.instance_id = r.instance_id AND (p.id, p.ord) < (r.id, r.ord) AND (e.ended IS NULL OR e.ended >= r.at)) AS before
FROM r ORDER BY r.id, r.ord
"""


def _until(cond, procs: dict[str, subprocess.Popen], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        for name, p in procs.items():
            assert p.poll() is None, f"{what}: {name} exited with {p.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_the_coordinator_never_routes_beyond_the_reported_cap(db_url, tmp_path):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("capacity", batch_size=GROUPS, group_size=N, eta=0, max_response_tokens=64).id
        admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(GROUPS)])
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("STALEFLOW_TOKEN", "STALEFLOW_API_URL")},
            "STALEFLOW_API_URL": server.url,
            "STALEFLOW_TOKEN": token(db_url, "admin"),
        }
        commands = {
            "coordinator": ["coordinator", "--run", str(run)],
            "rollout": [
                "rollout-worker",
                "--run",
                str(run),
                "--engine",
                "sim",
                "--max-running",
                str(CAP),
                "--kv-capacity",
                "100000",
                "--time-scale",
                "0.01",
            ],
        }
        procs = {}
        logs = {name: (tmp_path / f"{name}.log").open("w") for name in commands}
        try:
            for name, args in commands.items():
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "staleflow_cli.main", *args],
                    cwd=REPO,
                    env=env,
                    stdout=logs[name],
                    stderr=subprocess.STDOUT,
                )
            db = create_engine(db_url)
            with db.connect() as c:

                def finished() -> bool:
                    q = "SELECT count(*) FROM samples WHERE run_id = :r AND state = 'finished'"
                    return c.execute(text(q), {"r": run}).scalar_one() == GROUPS * N

                _until(finished, procs, "every sample to finish")
                rows = c.execute(text(IN_FLIGHT), {"run": run}).all()
                (snapshot,) = c.execute(text("SELECT snapshot FROM instances WHERE run_id = :r"), {"r": run}).scalars()
            db.dispose()
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.wait(timeout=WAIT_S)
            for f in logs.values():
                f.close()
    assert snapshot["capacity"] == {"max_running": CAP, "kv_capacity": 100_000}
    assert len(rows) >= GROUPS * N
    in_flight = [before + 1 for _, _, before in rows]  # counting the route itself
    assert max(in_flight) == CAP, in_flight  # both slots used, never a third
