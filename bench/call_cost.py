"""CPU and bytes per call of the hot calls, over real HTTP against a `staleflow serve` process
and a scratch database on the server of STALEFLOW_DATABASE_URL (else the embedded default).

    python bench/call_cost.py [--rounds 3 --wire packed|json --segment-tokens 256]

One client thread drives one run round by round (B groups of N routed to one instance): a
phase of heartbeats, of empty polls (wait 0), of partial reports (`--segments` segments of
`--segment-tokens` tokens each per call), the finishing reports, claims of one task each and
their rewards, `--consumes` consumes of the ready batch, a publish. Per phase it reads the CPU
time (user + system) of this process (the client), of the API server process and of the
database backends serving the scratch database, so the figures are CPU per call, not wall
clock, and barely move with the load of a shared machine. The API's idle CPU (its background
tasks) is measured first and taken out. Bytes are each request's and response's body.

`--node K` measures a node sync instead (`node_workload`): K instances' reports and snapshots
in one call against the same reports as K calls, and a node's poll against K polls; last line
``call_cost_node sync_api_us=A sync_db_us=D parts_api_us=PA parts_db_us=PD`` (parts: the K
separate calls together). With `--compare DIR` it runs this code and DIR's server, both packed.

`--wire json` makes the client send JSON lists of numbers (the form older clients send) where
it sends packed arrays by default. `--compare DIR` runs three targets side by side, a phase of
each in turn so that all see the same load: this code's server with a packed client and with a
JSON-list client, and the server and client of the code in DIR (say `git archive` of main) with
JSON lists; the last line is then the first target's.

Last line: ``call_cost heartbeat_api_us=H report_api_us=R poll_api_us=P heartbeat_client_us=C
report_client_us=RC report_req_bytes=B``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.server_stats import backend_cpu, scratch_database
from staleflow_db.db import database_url, make_engine


class Phase:
    """Sums of one kind of call: count, client / API / database CPU seconds, body bytes."""

    def __init__(self) -> None:
        self.calls = 0
        self.client = self.api = self.db = 0.0
        self.req = self.resp = 0


class Meter:
    def __init__(self, server_pid: int, db_url: str):
        self.server = psutil.Process(server_pid)
        self.db_url = db_url
        self.phases: dict[str, Phase] = defaultdict(Phase)
        self.idle_api_per_s = 0.0
        self.bytes = [0, 0]  # request, response bodies since the last phase began

    def api_cpu(self) -> float:
        total = 0.0
        for p in [self.server, *self.server.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def db_cpu(self) -> float:
        return sum(backend_cpu(self.db_url).values())

    def on_response(self, r: httpx.Response) -> None:
        self.bytes[0] += len(r.request.content)
        self.bytes[1] += int(r.headers.get("content-length", 0))

    def idle(self, seconds: float = 2.0) -> None:
        a0, t0 = self.api_cpu(), time.monotonic()
        time.sleep(seconds)
        self.idle_api_per_s = (self.api_cpu() - a0) / (time.monotonic() - t0)

    def phase(self, name: str, calls: list[Callable[[], Any]]) -> list[Any]:
        """Run `calls` back to back as one phase of `name`."""
        a0, d0, w0 = self.api_cpu(), self.db_cpu(), time.monotonic()
        self.bytes = [0, 0]
        c0 = time.process_time()
        out = [call() for call in calls]
        c1 = time.process_time()
        a1, d1, w1 = self.api_cpu(), self.db_cpu(), time.monotonic()
        ph = self.phases[name]
        ph.calls += len(calls)
        ph.client += c1 - c0
        ph.api += max(0.0, a1 - a0 - self.idle_api_per_s * (w1 - w0))
        ph.db += d1 - d0
        ph.req += self.bytes[0]
        ph.resp += self.bytes[1]
        return out

    def table(self) -> None:
        print(f"  {'call':<20}{'calls':>7}{'client us':>11}{'API us':>9}{'DB us':>8}{'req B':>10}{'resp B':>10}")
        for name, ph in self.phases.items():
            n = max(ph.calls, 1)
            print(
                f"  {name:<20}{ph.calls:>7}{ph.client / n * 1e6:>11.0f}{ph.api / n * 1e6:>9.0f}"
                f"{ph.db / n * 1e6:>8.0f}{ph.req / n:>10.0f}{ph.resp / n:>10.0f}"
            )

    def per_call(self, name: str, what: str) -> float:
        ph = self.phases[name]
        return getattr(ph, what) / max(ph.calls, 1)


LEASE = 3600.0  # the other targets take their turns between this one's phases


def workload(c: Any, meter: Meter, args: argparse.Namespace) -> Iterator[None]:
    """The calls, a phase at a time (it yields after each, so targets can take turns)."""
    B, N = args.batch, args.group
    run = c.create_run(
        f"call-cost-{uuid.uuid4().hex[:8]}", batch_size=B, group_size=N, eta=0, max_response_tokens=10_000_000
    ).id
    inst = c.register(run, "gpu0", 0, lease_seconds=LEASE).instance_id
    prompt = list(range(1, args.prompt_tokens + 1))
    tokens = [(7 * i) % 50_000 for i in range(args.segment_tokens)]
    logprobs = [-(i % 97) / 13.0 - 0.001 for i in range(args.segment_tokens)]  # not round in binary
    for rnd in range(args.rounds):
        c.heartbeat(
            run, inst, rnd, lease_seconds=LEASE
        )  # the instance holds version rnd (it pulled what was published)
        c.enqueue(run, [(f"r{rnd}p{g}", prompt) for g in range(B)])
        queued = [q.sample_id for q in c.snapshot(run).queued]
        outcomes = [r.outcome for r in c.route(run, [(s, inst) for s in queued])]
        work = c.poll(run, inst, wait=0).work
        if len(work) != B * N:
            raise RuntimeError(f"round {rnd}: {len(work)} samples routed of {B * N} ({outcomes})")
        routes = [(w.sample_id, w.attempt, w.route_token) for w in work]
        running = [{"sample_id": s, "tokens": 0} for s, _, _ in routes]
        snap = {"running": len(running), "kv_used": 1000, "running_samples": running, "throughput": 1234.5}
        meter.phase("heartbeat", [lambda: c.heartbeat(run, inst, rnd, snap, LEASE)] * args.calls)
        yield
        meter.phase("poll (empty)", [lambda: c.poll(run, inst, wait=0)] * args.calls)
        yield

        def segments(i: int, kind: str = "partial") -> list[dict[str, Any]]:
            picked = [routes[(i * args.segments + k) % len(routes)] for k in range(args.segments)]
            return [
                {"sample_id": s, "attempt": a, "route_token": t, "version": rnd, "tokens": tokens, "logprobs": logprobs}
                | {"kind": kind}
                for s, a, t in picked
            ]

        reports = [lambda i=i: c.report(run, inst, segments(i)) for i in range(args.calls // 2)]
        meter.phase("report (partial)", reports)
        yield
        last = [
            {"sample_id": s, "attempt": a, "route_token": t, "version": rnd, "tokens": tokens, "logprobs": logprobs}
            for s, a, t in routes
        ]
        meter.phase("report (finished)", [lambda r=r: c.report(run, inst, [r]) for r in last])
        yield
        tasks = meter.phase("claim (1 task)", [lambda: c.claim(run, limit=1, wait=0)] * len(routes))
        yield
        rewards = [(t[0].sample_id, t[0].reward_attempt, float(t[0].sample_id % 2)) for t in tasks]
        meter.phase("reward (1)", [lambda r=r: c.record_rewards(run, [r]) for r in rewards])
        yield
        batches = meter.phase("consume (batch)", [lambda: c.consume(run, rnd, wait=0)] * args.consumes)
        c.publish(run, rnd, batches[-1].consume_fence)
        yield


def node_workload(c: Any, meter: Meter, args: argparse.Namespace) -> Iterator[None]:
    """`--node K`: one node of K instances, each holding `--segments` routed samples. Phases:
    node syncs of K items (each a report of `--segments` partial segments of `--segment-tokens`
    tokens and a snapshot), the same reports as K separate report calls (the parts of one
    sync: per call, times K), node polls of all K (wait 0, nothing to deliver) and K separate
    empty polls."""
    k, n = args.node, args.segments
    run = c.create_run(
        f"call-cost-node-{uuid.uuid4().hex[:8]}", batch_size=k * n, group_size=1, eta=0, max_response_tokens=10_000_000
    ).id
    insts = [c.register(run, f"gpu{i}", 0, lease_seconds=LEASE).instance_id for i in range(k)]
    c.enqueue(run, [(f"p{g}", list(range(1, args.prompt_tokens + 1))) for g in range(k * n)])
    queued = [q.sample_id for q in c.snapshot(run).queued]
    c.route(run, [(s, insts[j // n]) for j, s in enumerate(queued)])
    routes = {d.instance_id: d.work for d in c.sync(run, poll=insts, wait=0).deliveries}
    if sorted(len(w) for w in routes.values()) != [n] * k:
        raise RuntimeError(f"{ {i: len(w) for i, w in routes.items()} } routed, {n} each wanted")
    tokens = [(7 * i) % 50_000 for i in range(args.segment_tokens)]
    logprobs = [-(i % 97) / 13.0 - 0.001 for i in range(args.segment_tokens)]

    def reports(inst: int) -> list[dict[str, Any]]:
        return [
            {"sample_id": w.sample_id, "attempt": w.attempt, "route_token": w.route_token, "version": 0}
            | {"tokens": tokens, "logprobs": logprobs, "kind": "partial"}
            for w in routes[inst]
        ]

    def snap(inst: int) -> dict[str, Any]:
        running = [{"sample_id": w.sample_id, "tokens": 100} for w in routes[inst]]
        return {"running": n, "kv_used": 1000, "running_samples": running, "throughput": 1234.5}

    items = [{"instance_id": i, "reports": reports(i), "snapshot": snap(i)} for i in insts]
    for _ in range(args.rounds):
        meter.phase(f"node sync ({k} items)", [lambda: c.sync(run, items)] * (args.calls // k))
        yield
        meter.phase(
            "report (1 of them)", [lambda i=i: c.report(run, i, reports(i), snap(i)) for i in insts] * (args.calls // k)
        )
        yield
        meter.phase(f"node poll ({k}, empty)", [lambda: c.sync(run, poll=insts, wait=0)] * (args.calls // k))
        yield
        meter.phase("poll (1, empty)", [lambda i=i: c.poll(run, i, wait=0) for i in insts] * (args.calls // k))
        yield


class Target:
    """One API server process and a client of it (its own run), with its meter."""

    def __init__(self, name: str, proc: subprocess.Popen, base: str, token: str, url: str, packed: bool):
        from workers.client import StaleFlowClient

        self.name, self.proc = name, proc
        self.meter = Meter(proc.pid, url)
        self.client = StaleFlowClient(base, token, timeout=60)
        if hasattr(self.client, "packed"):
            self.client.packed = packed
        self.client.http.event_hooks["response"].append(self.meter.on_response)


def serve(url: str, repo: Path) -> tuple[subprocess.Popen, str]:
    """`staleflow serve` of the code in `repo` against `url`, once it answers."""
    from staleflow_cli.launch import free_port

    port = free_port()
    env = {**os.environ, "STALEFLOW_DATABASE_URL": url, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-m", "staleflow_cli.main", "serve", "--port", str(port), "--no-upgrade"]
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=1) as http:
        for _ in range(600):
            try:
                if http.get(base + "/readyz").status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the API server of {repo} did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="batches trained")
    ap.add_argument("--batch", type=int, default=8, help="B: groups per batch")
    ap.add_argument("--group", type=int, default=4, help="N: samples per group")
    ap.add_argument("--calls", type=int, default=200, help="heartbeats and empty polls per round (reports: half)")
    ap.add_argument("--segments", type=int, default=4, help="segments per partial report")
    ap.add_argument("--segment-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--consumes", type=int, default=5, help="consumes of each ready batch (each a new fence)")
    ap.add_argument("--wire", choices=("packed", "json"), default="packed", help="how the client sends token arrays")
    ap.add_argument(
        "--node",
        type=int,
        default=0,
        help="K > 0: node syncs of K instances' reports against the same as K calls (node_workload);"
        " with --compare, this code and DIR's server, both packed",
    )
    ap.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="a checkout of other code (e.g. `git archive` of main): its server with JSON lists, this code's"
        " with JSON lists and packed, taking turns phase by phase, so all see the same load",
    )
    args = ap.parse_args()

    from api.auth import create_token

    server_url = os.environ.get("STALEFLOW_DATABASE_URL") or database_url()
    targets: list[Target] = []
    with scratch_database(server_url, "sf_callcost") as url:
        engine = make_engine(url)
        token = create_token(engine, "admin")["token"]
        engine.dispose()
        try:
            proc, base = serve(url, REPO)
            if args.compare is None:
                targets.append(Target(f"wire={args.wire}", proc, base, token, url, args.wire == "packed"))
            elif args.node:
                targets.append(Target("this code", proc, base, token, url, True))
                other, other_base = serve(url, args.compare.resolve())
                targets.append(Target(f"{args.compare}", other, other_base, token, url, True))
            else:
                targets.append(Target("this code, packed", proc, base, token, url, True))
                targets.append(Target("this code, JSON lists", proc, base, token, url, False))
                other, other_base = serve(url, args.compare.resolve())
                targets.append(Target(f"{args.compare}, JSON lists", other, other_base, token, url, False))
            time.sleep(1.0)
            for t in targets:
                t.meter.idle()
            load = os.getloadavg()[0]
            runs = [(node_workload if args.node else workload)(t.client, t.meter, args) for t in targets]
            while runs:  # a phase of each in turn
                for r in list(runs):
                    if next(r, StopIteration) is StopIteration:
                        runs.remove(r)
        finally:
            for t in targets:
                t.client.close()
            for p in {t.proc for t in targets}:
                p.terminate()
                p.wait(10)
    shape = (
        f"a node of {args.node} instances, reports of {args.segments} segments"
        if args.node
        else f"B={args.batch} N={args.group} segments/report={args.segments}"
    )
    print(
        f"rounds={args.rounds} {shape} x{args.segment_tokens} tokens; load1={load:.1f} on {os.cpu_count()} cores"
        " (the API's idle CPU taken out)"
    )
    for t in targets:
        print(f"{t.name}:")
        t.meter.table()
    meter = targets[0].meter
    if args.node:
        sync, parts = f"node sync ({args.node} items)", "report (1 of them)"
        print(
            f"call_cost_node sync_api_us={meter.per_call(sync, 'api') * 1e6:.0f}"
            f" sync_db_us={meter.per_call(sync, 'db') * 1e6:.0f}"
            f" parts_api_us={meter.per_call(parts, 'api') * args.node * 1e6:.0f}"
            f" parts_db_us={meter.per_call(parts, 'db') * args.node * 1e6:.0f}"
        )
        return
    us = {
        "heartbeat_api_us": meter.per_call("heartbeat", "api"),
        "report_api_us": meter.per_call("report (partial)", "api"),
        "poll_api_us": meter.per_call("poll (empty)", "api"),
        "heartbeat_client_us": meter.per_call("heartbeat", "client"),
        "report_client_us": meter.per_call("report (partial)", "client"),
    }
    line = " ".join(f"{k}={v * 1e6:.0f}" for k, v in us.items())
    print(f"call_cost {line} report_req_bytes={meter.per_call('report (partial)', 'req'):.0f}")


if __name__ == "__main__":
    main()
