"""Sustained load: 64 concurrent simulated workers (threads: a coordinator, a trainer, reward
workers and rollout instances, the workers of bench/api.py) against two API replicas
(`staleflow serve`) on a private embedded PostgreSQL, for `--seconds`. Reports errors (must be
0), throughput, p50/p99 per endpoint, and the database's connection count (sampled from
`pg_stat_activity`) against `max_connections`.

Connection budget: each replica holds at most pool + overflow connections plus one LISTEN
connection; this process holds a small pool (set-up, top-ups) and the sampler one. With the
defaults (max_connections 100, 3 reserved, pool 20 + overflow 10 per replica):
2 x (20 + 10 + 1) + 4 + 1 = 67 <= 97. `--pool/--overflow` change it; the budget is printed.

    python bench/load.py [--seconds 60] [--workers 64] [--pool 20] [--overflow 10]

Figures, not assertions. Last line: `load workers=W requests=N errors=E p99_ms=P`, P over every
request but the long-polls (whose latency is mostly the wait they were asked for).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

import psycopg

from bench.api import Recorder, Rest
from bench.harness import PrivatePostgres
from staleflow_cli.launch import Cluster
from staleflow_db import migrate
from staleflow_db.db import make_engine

RESERVED = 3  # superuser_reserved_connections: slots ordinary sessions cannot take
OWN_CONNECTIONS = 4 + 1  # this process: its pool (2 + 2 overflow) and the sampler


class Replicas(Rest):
    """bench/api.py's REST calls; each worker thread's client talks to one replica, in turn."""

    def __init__(self, url: str, bases: list[str], token: str):
        from workers.client import StaleFlowClient

        super().__init__(url, bases[0], token)
        turn = itertools.count()
        self.make = lambda: StaleFlowClient(bases[next(turn) % len(bases)], token, timeout=30)


class Load:
    def __init__(self, backend: Replicas, run: int, args: argparse.Namespace):
        self.b, self.run, self.args = backend, run, args
        self.rec, self.stop = Recorder(), threading.Event()
        self.errors: Counter[str] = Counter()
        self.samples: list[str] = []  # first few error messages
        self.published = [0]

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return self.rec.timed(name, fn)
        except Exception as e:
            self.errors[name] += 1
            if len(self.samples) < 10:
                self.samples.append(f"{name}: {type(e).__name__}: {e}")
            time.sleep(0.1)
            return None

    def coordinator(self) -> None:
        while not self.stop.is_set():
            got = self.timed("snapshot", lambda: self.b.snapshot(self.run))
            if got is None:
                continue
            queued, live = got
            if len(queued) < 4 * self.args.batch * self.args.group:
                prompts = [(f"t{time.monotonic_ns()}-{i}", [1 + i % 97, 2, 3, 4]) for i in range(8 * self.args.batch)]
                self.timed("enqueue", lambda: self.b.c.enqueue(self.run, prompts))
            pairs = [(s, live[i % len(live)]) for i, s in enumerate(queued[:2000])] if live else []
            routed = self.timed("route", lambda: self.b.route(self.run, pairs)) if pairs else 0
            self.rec.add(routed or 0)
            if not routed:
                time.sleep(0.01)

    def instance(self, i: int) -> None:
        inst = self.timed("register", lambda: self.b.register(self.run, f"load-{i}"))
        version, beat, tokens = 0, 0.0, list(range(self.args.tokens))
        while inst is not None and not self.stop.is_set():
            if self.published[0] != version or time.monotonic() - beat > 5:
                version, beat = self.published[0], time.monotonic()
                self.timed("heartbeat", lambda: self.b.heartbeat(self.run, inst, version))
            work = self.timed("poll (long-poll)", lambda: self.b.poll(self.run, inst, 1.0))
            if work:
                self.rec.add(self.timed("report", lambda: self.b.report(self.run, inst, work, version, tokens)) or 0)

    def rewarder(self) -> None:
        while not self.stop.is_set():
            tasks = self.timed("claim (long-poll)", lambda: self.b.claim(self.run, 64, 1.0))
            if tasks:
                occupied = self.timed(
                    "reward", lambda: self.b.reward(self.run, [(s, a, float(s % 2)) for s, a in tasks])
                )
                self.rec.add(2 * len(tasks) + (occupied or 0))

    def trainer(self) -> None:
        v = 0
        while not self.stop.is_set():
            fence = self.timed("consume (long-poll)", lambda: self.b.consume(self.run, v, 2.0))
            if fence is not None and self.timed("publish", lambda: self.b.publish(self.run, v, fence) or True):
                v += 1
                self.published[0] = v
                self.rec.add(2)

    def threads(self) -> list[threading.Thread]:
        a = self.args
        rollouts = a.workers - 2 - a.reward_workers
        targets = [self.coordinator, self.trainer] + [self.rewarder] * a.reward_workers
        targets += [lambda i=i: self.instance(i) for i in range(rollouts)]
        return [threading.Thread(target=t, daemon=True) for t in targets]


def sample_connections(url: str, stop: threading.Event, out: list[int]) -> None:
    with psycopg.connect(url, autocommit=True, application_name="sf-load-sampler") as c:
        while not stop.is_set():
            out.append(
                c.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'").fetchone()[0]
            )
            stop.wait(0.25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--workers", type=int, default=64, help="concurrent simulated workers (threads)")
    ap.add_argument("--reward-workers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="response tokens per sample")
    ap.add_argument("--pool", type=int, default=20, help="STALEFLOW_POOL_SIZE of each API replica")
    ap.add_argument("--overflow", type=int, default=10, help="STALEFLOW_MAX_OVERFLOW of each API replica")
    ap.add_argument("--max-connections", type=int, default=100)
    ap.add_argument("--report-dir", type=Path, default=Path("reports"))
    args = ap.parse_args()
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C: the service processes and the server are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = (args.report_dir / f"load-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    budget = 2 * (args.pool + args.overflow + 1) + OWN_CONNECTIONS
    print(
        f"connection budget: 2 replicas x (pool {args.pool} + overflow {args.overflow} + 1 LISTEN) + "
        f"{OWN_CONNECTIONS} here = {budget} of {args.max_connections - RESERVED} "
        f"(max_connections {args.max_connections} - {RESERVED} reserved)"
    )
    pg = PrivatePostgres(report / "home", {"max_connections": str(args.max_connections)})
    url = pg.start()
    try:
        migrate.upgrade(url)
        run_load(args, report, url, pg.max_connections())
    finally:
        pg.stop_fast()


def run_load(args: argparse.Namespace, report: Path, url: str, max_conn: int) -> None:
    from api.auth import create_token

    engine = make_engine(url, pool_size=2, max_overflow=2)
    token = create_token(engine, "admin")["token"]
    engine.dispose()
    env = {
        "STALEFLOW_POOL_SIZE": str(args.pool),
        "STALEFLOW_MAX_OVERFLOW": str(args.overflow),
        "STALEFLOW_HOME": str(report / "home"),
    }
    with Cluster(report, url, env=env) as cluster:
        bases = []
        for i in range(2):
            bases.append(cluster.start_api())
            cluster.procs[-1].name = f"api-{i}"
        backend = Replicas(url, bases, token)
        backend.engine.dispose()
        backend.engine = make_engine(url, pool_size=2, max_overflow=2)
        run = backend.c.create_run("load", batch_size=args.batch, group_size=args.group, eta=args.eta).id
        load = Load(backend, run, args)
        conns: list[int] = []
        sampler = threading.Thread(target=sample_connections, args=(url, load.stop, conns), daemon=True)
        threads = load.threads()
        sampler.start()
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        while time.perf_counter() - t0 < args.seconds:
            time.sleep(min(5.0, args.seconds - (time.perf_counter() - t0)))
            calls = sum(len(x) for x in load.rec.lat.values())
            print(
                f"  {time.perf_counter() - t0:5.0f}s: {calls} requests, {sum(load.errors.values())} errors, "
                f"version {load.published[0]}, connections {conns[-1] if conns else '?'}/{max_conn}",
                file=sys.stderr,
            )
        load.stop.set()
        for t in threads:
            t.join(10)
        seconds = time.perf_counter() - t0
        backend.engine.dispose()
    report_figures(load, seconds, conns, max_conn, args)


def report_figures(load: Load, seconds: float, conns: list[int], max_conn: int, args) -> None:
    lat = load.rec.lat
    # a long-poll's latency is mostly its wait: the headline p99 is over the other requests
    every = sorted(x for name, xs in lat.items() if "long-poll" not in name for x in xs)
    requests = sum(len(xs) for xs in lat.values()) + sum(load.errors.values())
    pct = lambda xs, q: xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else 0.0  # noqa: E731
    print(
        f"\n{args.workers} workers, 2 API replicas, {seconds:.0f} s: {requests} requests "
        f"({requests / seconds:,.0f}/s), {load.rec.transitions} transitions ({load.rec.transitions / seconds:,.0f}/s), "
        f"{load.published[0]} versions published"
    )
    print(f"  {'endpoint':<22}{'calls':>8}{'errors':>8}{'p50 ms':>10}{'p99 ms':>10}")
    for name in sorted(set(lat) | set(load.errors)):
        xs = sorted(lat.get(name, []))
        print(f"  {name:<22}{len(xs):>8}{load.errors[name]:>8}{pct(xs, 0.5):>10.1f}{pct(xs, 0.99):>10.1f}")
    if conns:
        print(
            f"database connections: max {max(conns)}, mean {sum(conns) / len(conns):.0f} "
            f"of max_connections {max_conn} ({len(conns)} samples)"
        )
    for s in load.samples:
        print("  error:", s)
    print(
        f"load workers={args.workers} requests={requests} errors={sum(load.errors.values())} "
        f"p99_ms={pct(every, 0.99):.0f}"
    )


if __name__ == "__main__":
    sys.exit(main())
