"""`Cluster.stop()` (what `with Cluster(...)` does on exit, and `staleflow demo` with it) stops
the workers before the API they deregister through: real processes, real HTTP, a sim rollout
worker of two instances; after the stop every instance is deregistered, not left active for its
lease to lapse (stopped together, the workers found the API gone)."""

from __future__ import annotations

import time

from api.auth import create_token
from staleflow_cli.launch import Cluster
from staleflow_db.db import make_engine
from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig

WAIT_S = 120.0  # guards against a hang, never a timing assertion


def test_stop_deregisters_every_instance_through_the_api(db_url, tmp_path):
    engine = make_engine(db_url)
    try:
        run = Protocol(engine).create_run("stop-order", RunConfig(batch_size=1, group_size=1, eta=0))
        rollout = create_token(engine, "rollout", run)["token"]

        def states() -> list[str]:
            with engine.connect() as c:
                return c.exec_driver_sql(f"SELECT state::text FROM instances WHERE run_id = {run}").scalars().all()

        with Cluster(tmp_path, db_url) as cluster:
            cluster.start_api()
            cluster.spawn(
                "rollout",
                ["rollout-worker", "--run", str(run), "--engine", "sim", "--instances", "2"],
                env={"STALEFLOW_TOKEN": rollout},
            )
            deadline = time.monotonic() + WAIT_S
            while states() != ["active", "active"]:
                cluster.check()
                assert time.monotonic() < deadline, "the instances did not register"
                time.sleep(0.1)
            cluster.stop()
        assert states() == ["deregistered", "deregistered"]
    finally:
        engine.dispose()
