"""REST API throughput: lifecycle transitions per second with concurrent simulated workers
making batched calls, p50/p99 latency per endpoint, and the ratio to the same workload run on
the in-process data layer in the same invocation (last line: ``api/inprocess=<x>``).

    python bench/api.py [--batch 32 --group 4 --eta 2 --steps 36 --instances 4 --api-workers 1 --pairs 3]

The database is STALEFLOW_DATABASE_URL's server (else the embedded default); each half of
the run gets a fresh database there, dropped afterwards. Benchmarks are not tests: compare
the ratio, not the absolute figures (the machine is shared and noisy). The halves run
`--pairs` times, alternating which goes first; the last line is the median pair's ratio.

Transitions counted: a sample routed, reported finished, claimed, rewarded; a group occupied;
a batch consumed; a version published.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.server_stats import backend_cpu
from staleflow_db import migrate
from staleflow_db.db import database_url, make_engine, with_database
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig
from workers.wire.enums import SegmentKind


class Recorder:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.transitions = 0
        self.lock = threading.Lock()

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        out = fn()
        with self.lock:
            self.lat[name].append(time.perf_counter() - t)
        return out

    def add(self, n: int) -> None:
        with self.lock:
            self.transitions += n


class InProcess:
    """The workload's calls on the data layer directly; long-polls become short sleeps."""

    def __init__(self, url: str):
        self.engine = make_engine(url)
        self.p = Protocol(self.engine)

    def _wait(self, fn: Callable[[], Any], done: Callable[[Any], bool], wait: float) -> Any:
        deadline = time.monotonic() + wait
        while True:
            out = fn()
            if done(out) or time.monotonic() >= deadline:
                return out
            time.sleep(0.002)

    def setup(self, cfg: dict[str, Any], prompts: list[tuple[str, list[int]]]) -> int:
        run = self.p.create_run("bench", RunConfig(**cfg))
        for i in range(0, len(prompts), 1000):
            self.p.enqueue(run, [Prompt(k, t) for k, t in prompts[i : i + 1000]])
        return run

    def register(self, run: int, name: str) -> int:
        return self.p.register_instance(run, name, 0)

    def heartbeat(self, run: int, inst: int, version: int) -> None:
        self.p.heartbeat(inst, version, {"running": 0, "waiting": 0}, 30.0)

    def snapshot(self, run: int) -> tuple[list[int], list[int]]:
        s = self.p.snapshot(run)
        return [q.sample_id for q in s.queued], [i.id for i in s.instances]

    def route(self, run: int, pairs: list[tuple[int, int]]) -> int:
        return sum(r.outcome == "routed" for r in self.p.route(run, pairs))

    def poll(self, run: int, inst: int, wait: float) -> list[tuple[int, int, str]]:
        work = self._wait(lambda: self.p.poll_work(inst, 1000).work, bool, wait)
        return [(w.sample_id, w.attempt, w.route_token) for w in work]

    def report(self, run: int, inst: int, items: list[tuple[int, int, str]], version: int, tokens: list[int]) -> int:
        return self.p.report(
            run,
            [
                Report(
                    s,
                    a,
                    version,
                    tokens,
                    [-0.5] * len(tokens),
                    SegmentKind.FINISHED,
                    instance_id=inst,
                    route_token=token,
                )
                for s, a, token in items
            ],
        )

    def claim(self, run: int, limit: int, wait: float) -> list[tuple[int, int]]:
        tasks = self._wait(lambda: self.p.claim_rewards(run, limit, 60.0), bool, wait)
        return [(t.sample_id, t.reward_attempt) for t in tasks]

    def reward(self, run: int, items: list[tuple[int, int, float]]) -> int:
        return sum(o.state == "occupied" for o in self.p.record_rewards(run, items))

    def consume(self, run: int, version: int, wait: float) -> int | None:
        batch = self._wait(lambda: self.p.consume(run, version), lambda b: b is not None, wait)
        return None if batch is None else batch.consume_fence

    def publish(self, run: int, version: int, fence: int) -> None:
        self.p.publish(run, version, fence, 1, "x", "bench")

    def close(self) -> None:
        self.engine.dispose()


class Rest(InProcess):
    """The same calls through the worker client against a `staleflow serve` subprocess."""

    def __init__(self, url: str, base_url: str, token: str):
        from workers.client import StaleFlowClient

        super().__init__(url)
        self.local = threading.local()
        self.make = lambda: StaleFlowClient(base_url, token, timeout=30)

    @property
    def c(self):  # one HTTP client per worker thread
        if not hasattr(self.local, "c"):
            self.local.c = self.make()
        return self.local.c

    def register(self, run: int, name: str) -> int:
        return self.c.register(run, name, 0).instance_id

    def heartbeat(self, run: int, inst: int, version: int) -> None:
        self.c.heartbeat(run, inst, version, {"running": 0, "waiting": 0}, 30.0)

    def snapshot(self, run: int) -> tuple[list[int], list[int]]:
        s = self.c.snapshot(run)
        return [q.sample_id for q in s.queued], [i.instance_id for i in s.instances]

    def route(self, run: int, pairs: list[tuple[int, int]]) -> int:
        return sum(r.outcome == "routed" for r in self.c.route(run, pairs))

    def poll(self, run: int, inst: int, wait: float) -> list[tuple[int, int, str]]:
        return [(w.sample_id, w.attempt, w.route_token) for w in self.c.poll(run, inst, wait=wait).work]

    def report(self, run: int, inst: int, items: list[tuple[int, int, str]], version: int, tokens: list[int]) -> int:
        logprobs = [-0.5] * len(tokens)
        return self.c.report(
            run,
            inst,
            [
                {
                    "sample_id": s,
                    "attempt": a,
                    "route_token": token,
                    "version": version,
                    "tokens": tokens,
                    "logprobs": logprobs,
                }
                for s, a, token in items
            ],
        )

    def claim(self, run: int, limit: int, wait: float) -> list[tuple[int, int]]:
        return [(t.sample_id, t.reward_attempt) for t in self.c.claim(run, limit=limit, wait=wait)]

    def reward(self, run: int, items: list[tuple[int, int, float]]) -> int:
        return sum(o.state == "occupied" for o in self.c.record_rewards(run, items))

    def consume(self, run: int, version: int, wait: float) -> int | None:
        batch = self.c.consume(run, version, wait=wait)
        return None if batch is None else batch.consume_fence

    def publish(self, run: int, version: int, fence: int) -> None:
        self.c.publish(run, version, fence, 1, "x", "bench")


def workload(backend: InProcess, args: argparse.Namespace) -> tuple[float, Recorder]:
    """Coordinator, instances, reward workers and a trainer as threads; returns (seconds, recorder)."""
    cfg = dict(batch_size=args.batch, group_size=args.group, eta=args.eta)
    n_prompts = args.batch * (args.steps + args.eta + 1)
    run = backend.setup(cfg, [(f"p{i}", [1 + i % 97, 2, 3, 4]) for i in range(n_prompts)])
    rec, stop = Recorder(), threading.Event()
    published = [0]  # what the parameter server holds: instances "pull" it on their next heartbeat
    instances = [backend.register(run, f"gpu{i}") for i in range(args.instances)]
    tokens = list(range(args.tokens))
    errors: list[BaseException] = []

    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run_() -> None:
            try:
                fn()
            except BaseException as exc:  # surface worker failures instead of hanging
                errors.append(exc)
                stop.set()

        return run_

    def coordinator() -> None:
        while not stop.is_set():
            queued, live = rec.timed("snapshot", lambda: backend.snapshot(run))
            pairs = [(s, live[i % len(live)]) for i, s in enumerate(queued[:2000])] if live else []
            routed = rec.timed("route", lambda: backend.route(run, pairs)) if pairs else 0
            rec.add(routed)
            if not routed:
                time.sleep(0.005)

    def instance(inst: int) -> Callable[[], None]:
        def loop() -> None:
            version, beat = 0, 0.0
            while not stop.is_set():
                if published[0] != version or time.monotonic() - beat > 5:
                    version, beat = published[0], time.monotonic()
                    rec.timed("heartbeat", lambda: backend.heartbeat(run, inst, version))
                work = rec.timed("poll (long-poll)", lambda: backend.poll(run, inst, 0.2))
                if work:
                    rec.add(rec.timed("report", lambda: backend.report(run, inst, work, version, tokens)))

        return loop

    def rewarder() -> None:
        while not stop.is_set():
            tasks = rec.timed("claim (long-poll)", lambda: backend.claim(run, 256, 0.5))
            if tasks:
                rec.add(len(tasks))
                occupied = rec.timed("reward", lambda: backend.reward(run, [(s, a, float(s % 2)) for s, a in tasks]))
                rec.add(len(tasks) + occupied)

    def trainer() -> None:
        for v in range(args.steps):
            fence, deadline = None, time.monotonic() + 60
            while fence is None and not stop.is_set():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no batch at version {v} within 60 s: the workload is stuck")
                fence = rec.timed("consume (long-poll)", lambda: backend.consume(run, v, 2.0))
            if fence is None:
                return
            rec.timed("publish", lambda: backend.publish(run, v, fence))
            published[0] = v + 1
            rec.add(2)
        stop.set()

    threads = [threading.Thread(target=guard(coordinator)), threading.Thread(target=guard(trainer))]
    threads += [threading.Thread(target=guard(instance(i))) for i in instances]
    threads += [threading.Thread(target=guard(rewarder)) for _ in range(args.reward_workers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, rec


def fresh_database(admin_url: str, tag: str) -> str:
    name = f"bench_api_{tag}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = with_database(admin_url, name)
    migrate.upgrade(url)
    return url


def drop_database(admin_url: str, url: str) -> None:
    name = url.rsplit("/", 1)[1].split("?")[0]
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_server(url: str, workers: int) -> tuple[subprocess.Popen, str]:
    import httpx

    from staleflow_cli.launch import free_port

    port = free_port()
    env = {**os.environ, "STALEFLOW_DATABASE_URL": url}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "staleflow_cli.main",
            "serve",
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--no-upgrade",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=1) as http:  # one client: each httpx.get builds an SSL context
        for _ in range(300):
            try:
                if http.get(base + "/readyz").status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the API server did not start")


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process, or of process `pid` and its children."""
    if pid is None:
        return time.process_time()
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def database_cpu_seconds(url: str) -> float:
    """CPU time of the PostgreSQL backends serving `url`'s database (`server_stats.backend_cpu`).
    A backend that exits during the run takes its time with it: the pools here live throughout."""
    return sum(backend_cpu(url).values())


def report_figures(label: str, seconds: float, rec: Recorder, cpu: dict[str, float]) -> float:
    rate = rec.transitions / seconds
    print(f"\n{label}: {rec.transitions} transitions in {seconds:.2f}s = {rate:,.0f}/s")
    # CPU per transition: on a shared machine, less noisy than the wall-clock rate
    # ("database": this run's PostgreSQL backends, 0 where they cannot be read).
    per = ", ".join(f"{k} {v * 1e3 / max(rec.transitions, 1):.2f}" for k, v in cpu.items())
    print(f"  CPU ms per transition: {per} (total {sum(cpu.values()) * 1e3 / max(rec.transitions, 1):.2f})")
    print(f"  {'endpoint':<22}{'calls':>7}{'p50 ms':>10}{'p99 ms':>10}")
    for name, xs in sorted(rec.lat.items()):
        xs = sorted(xs)
        p50, p99 = xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))]
        print(f"  {name:<22}{len(xs):>7}{p50 * 1e3:>10.2f}{p99 * 1e3:>10.2f}")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32, help="B: groups per batch")
    ap.add_argument("--group", type=int, default=4, help="N: samples per group")
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument(
        "--steps",
        type=int,
        default=36,
        help="batches trained (versions published); 36 keeps each half ~6 s, long enough that pairs agree",
    )
    ap.add_argument("--instances", type=int, default=4, help="simulated rollout instances")
    ap.add_argument("--reward-workers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="response tokens per sample")
    ap.add_argument("--api-workers", type=int, default=1, help="uvicorn worker processes")
    ap.add_argument("--pairs", type=int, default=3, help="REST / in-process runs, alternated; the median ratio")
    args = ap.parse_args()

    admin_url = with_database(database_url(), "postgres")
    print(
        f"workload: B={args.batch} N={args.group} eta={args.eta} steps={args.steps} instances={args.instances} "
        f"reward workers={args.reward_workers} tokens/sample={args.tokens} api workers={args.api_workers}"
    )
    # One pair is two ~2-s runs: on a shared 2-core machine either may lose a third of its
    # rate to a neighbour. Pairs alternate their order (REST first, then in-process first), so
    # a load that rises or falls through the run weighs on both sides alike; the median pair
    # ratio is the answer, every pair printed.
    ratios = []
    for i in range(args.pairs):
        halves = (rest_half, local_half) if i % 2 == 0 else (local_half, rest_half)
        rates = {half.__name__: half(admin_url, args) for half in halves}
        ratios.append(rates["rest_half"] / rates["local_half"])
        print(f"\npair {i + 1}: api/inprocess={ratios[-1]:.3f}")
    if len(ratios) > 1:
        print(f"\npairs: {' '.join(f'{r:.3f}' for r in ratios)} (median of {len(ratios)})")
    print(f"api/inprocess={statistics.median(ratios):.3f}")


def rest_half(admin_url: str, args: argparse.Namespace) -> float:
    url = fresh_database(admin_url, "rest")
    proc, base = start_server(url, args.api_workers)
    try:
        from api.auth import create_token

        engine = make_engine(url)
        token = create_token(engine, "admin")["token"]
        engine.dispose()
        rest = Rest(url, base, token)
        rest.setup = lambda cfg, prompts: _rest_setup(rest, cfg, prompts)  # type: ignore[method-assign]
        c0, s0, d0 = cpu_seconds(), cpu_seconds(proc.pid), database_cpu_seconds(url)
        seconds, rec = workload(rest, args)
        cpu = {
            "clients": cpu_seconds() - c0,
            "API server": cpu_seconds(proc.pid) - s0,
            "database": database_cpu_seconds(url) - d0,
        }
        return report_figures("REST API", seconds, rec, cpu)
    finally:
        proc.terminate()
        proc.wait(10)
        drop_database(admin_url, url)


def local_half(admin_url: str, args: argparse.Namespace) -> float:
    url = fresh_database(admin_url, "inproc")
    try:
        local = InProcess(url)
        c0, d0 = cpu_seconds(), database_cpu_seconds(url)
        seconds, rec = workload(local, args)
        cpu = {"in-process": cpu_seconds() - c0, "database": database_cpu_seconds(url) - d0}
        local.close()
        return report_figures("in-process data layer", seconds, rec, cpu)
    finally:
        drop_database(admin_url, url)


def _rest_setup(rest: Rest, cfg: dict[str, Any], prompts: list[tuple[str, list[int]]]) -> int:
    run = rest.c.create_run("bench", **cfg).id
    for i in range(0, len(prompts), 1000):
        rest.c.enqueue(run, prompts[i : i + 1000])
    return run


if __name__ == "__main__":
    main()
