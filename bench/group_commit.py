"""Group commit, side by side: the same closed-loop load of small writes against one API
replica with coalescing off and on (`STALEFLOW_API_GROUP_COMMIT`), on a private embedded
PostgreSQL (durable commits: fsync and synchronous_commit as shipped).

Each of `--callers` callers owns a rollout instance with one routed sample and posts back to
back, as busy instances do: a partial segment report (2 tokens) and, every `--heartbeat-every`
calls, a lease renewal instead. Callers are threads spread over `--processes` load processes.
Per mode, after a warm-up, a window of `--seconds`: calls/s, client p50/p99, database
transactions per call (pg_stat_database's commits and rollbacks of the bench database, every
other session of the replica included), calls per group transaction (the replica's
`staleflow_group_commit_transaction_calls`), CPU per call of the PostgreSQL processes and of
the API replica (psutil, microseconds), and of the load processes.

    python bench/group_commit.py [--callers 32] [--processes 2] [--seconds 20] [--heartbeat-every 10]

Last line: `group_commit calls_per_tx_off=A calls_per_tx_on=B db_us_off=C db_us_on=D
api_us_off=E api_us_on=F calls_per_s_off=G calls_per_s_on=H`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

import httpx
import numpy as np
import psutil
import psycopg

from bench.capacity import CPU
from bench.harness import PrivatePostgres
from staleflow_cli.launch import Cluster
from staleflow_db import migrate

SPAWN = mp.get_context("spawn")


def setup(url: str, base: str, callers: int, name: str) -> tuple[int, str, list[tuple[int, dict]]]:
    """A run with one instance per caller, each holding one routed sample: (run, rollout token,
    [(instance, the sample's reporting identity)])."""
    from api.auth import create_token
    from staleflow_db.db import make_engine
    from staleflow_db.protocol import Prompt, Protocol
    from staleflow_db.types import RunConfig

    engine = make_engine(url, pool_size=2, max_overflow=2)
    p = Protocol(engine)
    run = p.create_run(name, RunConfig(batch_size=callers, group_size=1, eta=1, max_response_tokens=1_000_000))
    token = create_token(engine, "rollout", run)["token"]
    samples = p.enqueue(run, [Prompt(f"q{i}", [1, 2, 3]) for i in range(callers)])
    headers = {"Authorization": f"Bearer {token}"}
    owned = []
    with httpx.Client(base_url=f"{base}/v1/runs/{run}", headers=headers, timeout=60) as http:
        for i, g in enumerate(samples):
            iid = http.post("/instances", json={"name": f"c{i}", "version": 0, "lease_seconds": 600}).json()[
                "instance_id"
            ]
            with engine.connect() as c:
                from sqlalchemy import text

                (s,) = c.execute(text("SELECT id FROM samples WHERE group_id = :g"), {"g": g}).scalars().all()
            (r,) = p.route(run, [(s, iid)])
            owned.append((iid, {"sample_id": s, "attempt": r.attempt, "route_token": str(r.route_token)}))
    engine.dispose()
    return run, token, owned


def load_main(base: str, run: int, token: str, owned: list, heartbeat_every: int, go, stop_at, out) -> None:
    """One load process: says it is ready, waits for `go`, then a thread per caller posts back
    to back until `stop_at`; sends [(end time, seconds, ok)] per call."""
    out.put("ready")
    go.wait()
    results: list[tuple[float, float, bool]] = []
    lock = threading.Lock()

    def caller(iid: int, ident: dict) -> None:
        mine = []
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=f"{base}/v1/runs/{run}/instances/{iid}", headers=headers, timeout=60) as http:
            n = 0
            while time.time() < stop_at.value:
                n += 1
                t0 = time.perf_counter()
                if n % heartbeat_every == 0:
                    r = http.post("/heartbeat", json={"version": 0, "lease_seconds": 600})
                else:
                    report = {**ident, "version": 0, "tokens": [7, 8], "logprobs": [-0.5, -0.5], "kind": "partial"}
                    r = http.post("/segments", json={"reports": [report]})
                mine.append((time.time(), time.perf_counter() - t0, r.status_code == 200))
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=caller, args=o) for o in owned]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(results)


def _transactions(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        return int(row[0])


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def measure(args, url: str, workdir: Path, mode: bool, postmaster: int) -> dict:
    env = {
        "STALEFLOW_API_GROUP_COMMIT": "true" if mode else "false",
        **({"STALEFLOW_API_GROUP_COMMIT_LANES": str(args.lanes)} if args.lanes else {}),
        "STALEFLOW_HOME": str(workdir / "home"),
    }
    with Cluster(workdir / ("on" if mode else "off"), url, env=env) as cluster:
        base = cluster.start_api()
        api_pid = cluster.procs[-1].popen.pid
        run, token, owned = setup(url, base, args.callers, f"gc-{workdir.name}-{'on' if mode else 'off'}")
        q, go, stop_at = SPAWN.Queue(), SPAWN.Event(), SPAWN.Value("d", 0.0)
        shares = np.array_split(np.arange(len(owned)), args.processes)
        procs = [
            SPAWN.Process(
                target=load_main,
                args=(base, run, token, [owned[i] for i in share], args.heartbeat_every, go, stop_at, q),
            )
            for share in shares
        ]
        for p in procs:
            p.start()
        for _ in procs:
            assert q.get() == "ready"
        start = time.time()
        stop_at.value = start + args.warmup + args.seconds
        go.set()
        db_cpu, api_cpu, load_cpu = (
            CPU(lambda: [postmaster]),
            CPU(lambda: [api_pid]),
            CPU(lambda: [p.pid for p in procs]),
        )
        while time.time() < start + args.warmup:
            time.sleep(0.05)
        for c in (db_cpu, api_cpu, load_cpu):
            c.reset()
        tx0 = _transactions(url)
        groups0 = _metric(base, "staleflow_group_commit_transaction_calls_count")
        grouped0 = _metric(base, "staleflow_group_commit_transaction_calls_sum")
        window_start = time.time()
        while time.time() < stop_at.value:
            time.sleep(0.5)
            for c in (db_cpu, api_cpu, load_cpu):
                c.sample()
        tx1 = _transactions(url)
        groups = _metric(base, "staleflow_group_commit_transaction_calls_count") - groups0
        grouped = _metric(base, "staleflow_group_commit_transaction_calls_sum") - grouped0
        window_end = time.time()
        results = [r for _ in procs for r in q.get()]
        for p in procs:
            p.join()
    inside = [r for r in results if window_start <= r[0] <= window_end]
    calls = len(inside)
    errors = sum(1 for r in inside if not r[2])
    lat = np.array([r[1] for r in inside]) * 1000 if inside else np.zeros(1)
    secs = window_end - window_start
    tx = tx1 - tx0 - 2  # less this bench's own two reads of the counter
    return dict(
        mode="on" if mode else "off",
        calls=calls,
        errors=errors,
        calls_per_s=calls / secs,
        p50_ms=float(np.percentile(lat, 50)),
        p99_ms=float(np.percentile(lat, 99)),
        db_tx=tx,
        calls_per_tx=calls / max(tx, 1),
        calls_per_group=grouped / groups if groups else 0.0,
        db_us=db_cpu.seconds / max(calls, 1) * 1e6,
        api_us=api_cpu.seconds / max(calls, 1) * 1e6,
        load_us=load_cpu.seconds / max(calls, 1) * 1e6,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--callers", type=int, default=32)
    ap.add_argument("--processes", type=int, default=2, help="load processes (callers are threads in them)")
    ap.add_argument("--seconds", type=float, default=20, help="measured window per mode")
    ap.add_argument("--warmup", type=float, default=5)
    ap.add_argument("--heartbeat-every", type=int, default=10, help="every Nth call renews the lease instead")
    ap.add_argument("--lanes", type=int, default=None, help="STALEFLOW_API_GROUP_COMMIT_LANES (default: the setting's)")
    ap.add_argument("--rounds", type=int, default=1, help="off/on pairs, alternating (noise on a shared machine)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sf-gc-") as tmp:
        work = Path(tmp)
        pg = PrivatePostgres(work / "pg")
        url = pg.start()
        try:
            migrate.upgrade(url)
            with psycopg.connect(url, autocommit=True) as c:
                postmaster = psutil.Process(c.execute("SELECT pg_backend_pid()").fetchone()[0]).parent().pid
            rows = []
            for r in range(args.rounds):
                for mode in (False, True):
                    row = measure(args, url, work / f"r{r}", mode, postmaster)
                    rows.append(row)
                    print(
                        f"  {row['mode']:>3}: calls/s {row['calls_per_s']:.0f}  errors {row['errors']}  p50 "
                        f"{row['p50_ms']:.1f} ms  p99 {row['p99_ms']:.1f} ms  calls/db-tx {row['calls_per_tx']:.2f}"
                        f"  calls/group {row['calls_per_group']:.2f}  db {row['db_us']:.0f} us/call  api "
                        f"{row['api_us']:.0f} us/call  load {row['load_us']:.0f} us/call",
                        file=sys.stderr,
                    )
        finally:
            pg.stop_fast()

    def med(mode: str, key: str) -> float:
        return float(np.median([r[key] for r in rows if r["mode"] == mode]))

    print(
        f"group_commit calls_per_tx_off={med('off', 'calls_per_tx'):.2f} calls_per_tx_on={med('on', 'calls_per_tx'):.2f}"
        f" db_us_off={med('off', 'db_us'):.0f} db_us_on={med('on', 'db_us'):.0f}"
        f" api_us_off={med('off', 'api_us'):.0f} api_us_on={med('on', 'api_us'):.0f}"
        f" calls_per_s_off={med('off', 'calls_per_s'):.0f} calls_per_s_on={med('on', 'calls_per_s'):.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
