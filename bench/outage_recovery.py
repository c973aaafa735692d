"""How fast a running service recovers from a PostgreSQL restart.

A small `sim` run (API, coordinator, sim rollout workers, reward worker, sim trainer, each a
`staleflow` process) on a throwaway embedded PostgreSQL; the database is stopped for
`--down` seconds, `--outages` times. After each restart it prints, in seconds after the
server accepted connections again: /readyz 200, the first coordinator cycle, the first
reported segment, and the first published version ("first step"); and how many processes
exited (with `--supervise` they are restarted, as an external supervisor would).

    python bench/outage_recovery.py [--outages 3] [--down 3] [--supervise]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

# bench/api.py would shadow the `api` package when this runs as `python bench/outage_recovery.py`
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import httpx
from sqlalchemy import text

from api.auth import create_token
from staleflow_cli.launch import Cluster
from staleflow_db import migrate
from staleflow_db.db import make_engine
from staleflow_db.embedded import EmbeddedPostgres
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from workers.rollout.engines.sim_engine import encode_prompt

FAST = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def first_after(engine, started_at: float, sql: str, run: int) -> float | None:
    """Seconds from `started_at` (epoch) to the first row the query finds after it."""
    with engine.connect() as c:
        at = c.execute(text(sql), {"r": run, "t": started_at}).scalar()
    return None if at is None else float(at) - started_at


QUERIES = {
    "coordinator cycle": "SELECT extract(epoch FROM min(at)) FROM coordinator_cycles"
    " WHERE run_id = :r AND at > to_timestamp(:t)",
    "segment reported": "SELECT extract(epoch FROM min(s.created_at)) FROM segments s JOIN samples x"
    " ON x.id = s.sample_id JOIN prompt_groups g ON g.id = x.group_id"
    " WHERE g.run_id = :r AND s.created_at > to_timestamp(:t)",
    "version published": "SELECT extract(epoch FROM min(created_at)) FROM param_versions"
    " WHERE run_id = :r AND created_at > to_timestamp(:t)",
    # a whole step of new work: routed, generated, rewarded and trained after the restart
    "2nd version published": "SELECT extract(epoch FROM min(created_at)) FROM (SELECT created_at FROM param_versions"
    " WHERE run_id = :r AND created_at > to_timestamp(:t) ORDER BY created_at"
    " OFFSET 1) AS later",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outages", type=int, default=3)
    ap.add_argument("--down", type=float, default=3.0, help="seconds the database stays down")
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--supervise", action="store_true", help="restart processes that exit")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="sf-outage-"))
    pg = EmbeddedPostgres(home, server_options=FAST)
    try:
        pg.start()
        measure(pg, args)
    finally:
        pg.stop()
        shutil.rmtree(home, ignore_errors=True)


def measure(pg: EmbeddedPostgres, args: argparse.Namespace) -> None:
    home = pg.home
    url = pg.url()
    migrate.upgrade(url)
    engine = make_engine(url)
    protocol = Protocol(engine)
    run = protocol.create_run(
        "outage", RunConfig(batch_size=4, group_size=2, eta=1, max_response_tokens=256, max_prompt_tokens=64)
    )
    protocol.enqueue(run, [Prompt(f"g{k}", encode_prompt(16, 48, 0.4)) for k in range(4000)])
    tok = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward")}
    engine.dispose()
    results, restarts = [], 0
    with Cluster(home / "work", url, env={"STALEFLOW_SIM_TIME_SCALE": "0.01"}) as cluster:
        api = cluster.start_api()
        common = ["--run", str(run)]
        specs = {
            "coordinator": (["coordinator", *common, "--lease", "3"], {}),
            "reward": (["reward-worker", *common, "--verifier", "sim"], {"STALEFLOW_TOKEN": tok["reward"]}),
            "trainer": (
                ["trainer", *common, "--sim", "--sim-overhead", "0.2", "--sim-s-per-token", "0", "--wait", "5"],
                {"STALEFLOW_TOKEN": tok["trainer"]},
            ),
        }
        for i in range(args.rollouts):
            specs[f"rollout-{i}"] = (
                ["rollout-worker", *common, "--engine", "sim", "--heartbeat", "0.25"],
                {"STALEFLOW_TOKEN": tok["rollout"]},
            )
        for name, (argv, env) in specs.items():
            cluster.spawn(name, argv, env=env, essential=False)

        def supervise() -> None:
            nonlocal restarts
            for p in list(cluster.procs):
                if p.name in specs and p.popen.poll() is not None and not p.name.endswith("!"):
                    p.name += "!"  # replaced
                    restarts += 1
                    if args.supervise:
                        argv, env = specs[p.name[:-1]]
                        cluster.spawn(p.name[:-1], argv, env=env, essential=False)

        def wait(cond, timeout: float = 120.0) -> float | None:
            t0 = time.monotonic()
            while time.monotonic() - t0 < timeout:
                supervise()
                if cond():
                    return time.monotonic() - t0
                time.sleep(0.05)
            return None

        def ready() -> bool:
            try:
                return httpx.get(f"{api}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        eng = make_engine(url)
        version = lambda: Protocol(eng).reads.status(run)["version"]  # noqa: E731
        wait(lambda: version() >= 2)
        for k in range(args.outages):
            v0 = version()
            wait(lambda: version() > v0)
            eng.dispose()
            pg.stop()
            wait(lambda: False, timeout=args.down)  # a supervisor restarts what exits meanwhile
            pg.start()
            up = time.time()
            row = {"outage": k + 1, "readyz 200": wait(ready)}
            wait(lambda: all(first_after(eng, up, sql, run) is not None for sql in QUERIES.values()))
            row.update({name: first_after(eng, up, sql, run) for name, sql in QUERIES.items()})
            row["exited so far"] = restarts
            results.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        eng.dispose()


if __name__ == "__main__":
    main()
