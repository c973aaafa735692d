"""docs/examples/rollout.sh -- a rollout driven from the shell with curl + jq -- against the
real API: it registers, heartbeats, long-polls the work a coordinator routes to it, reports
finished segments (attempt and route token quoted) and deregisters; the samples are finished
with its tokens."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
from api_helpers import REPO, ApiServer, token
from sqlalchemy import text

from staleflow_db.payloads import unpack_tokens
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig

pytestmark = pytest.mark.skipif(not (shutil.which("jq") and shutil.which("curl")), reason="needs jq and curl")
SCRIPT = REPO / "docs/examples/rollout.sh"


def test_rollout_from_the_shell(db_url, engine, tmp_path):
    protocol = Protocol(engine)
    run = protocol.create_run("shell", RunConfig(batch_size=2, group_size=2, eta=1, max_response_tokens=2))
    protocol.enqueue(run, [Prompt(f"p{i}", [1, 2, 3], {}) for i in range(2)])
    with ApiServer(db_url) as api:
        env = {**os.environ, "STALEFLOW_API_URL": api.url, "STALEFLOW_TOKEN": token(db_url, "rollout", run)}
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), str(run), "4"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            coordinator = api.client(token(db_url, "coordinator", run))
            deadline = time.monotonic() + 60
            while not (snap := coordinator.snapshot(run)).instances:  # the script registered
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
                time.sleep(0.2)
            (instance,) = snap.instances
            results = coordinator.route(run, [(q.sample_id, instance.instance_id) for q in snap.queued])
            assert [r.outcome for r in results] == ["routed"] * 4
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, out
    assert "4 in all" in out, out
    with engine.connect() as c:
        samples = c.execute(
            text(
                "SELECT s.state::text, g.token_ids FROM samples s JOIN segments g ON g.sample_id = s.id "
                "WHERE s.run_id = :r"
            ),
            {"r": run},
        ).all()
        instances = c.execute(text("SELECT state::text FROM instances WHERE run_id = :r"), {"r": run}).scalars().all()
    assert sorted(s for s, _ in samples) == ["finished"] * 4, samples
    assert all(unpack_tokens(t) == [65, 66] for _, t in samples)  # cut to max_new_tokens
    assert instances != ["active"]  # deregistered on exit
