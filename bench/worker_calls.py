"""Calls per generated sample made by real rollout workers.

`--instances` RolloutWorkers (workers/rollout/worker.py) with the cost-model sim engine run in
this process, each with its own client whose HTTP requests are counted (an httpx event hook);
the coordinator (`staleflow coordinator`, the staleflow policy) and the sim trainer
(`staleflow trainer --sim`) are real processes, and a reward loop here scores every sample 1.0.
After `--warmup` seconds the counts are reset and `--seconds` measured: the instances' calls by
endpoint, divided by the samples they finished (the samples they reported `finished`).

    python bench/worker_calls.py [--instances 4] [--seconds 30] [--max-running 32] [--instances-per-node K]

With `--instances-per-node K` the instances run as nodes of K (workers/rollout/node.py, one client
per node): their calls are the node's syncs, and it prints how many of a node's instances a
flush carried on average.

(The agentic shape is bench/capacity.py's `--turns`, whose instances follow this worker.)
`STALEFLOW_DATABASE_URL` set: that server (migrated here) instead of a private embedded one.
Last line: `worker_calls instances=N samples=S calls_per_sample=C heartbeats=H polls=P reports=R`
(H, P, R: per sample).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

import httpx

from bench.harness import PrivatePostgres
from staleflow_cli.launch import Cluster
from staleflow_db import migrate
from workers.client import StaleFlowClient
from workers.rollout.engines.sim_engine import SimEngine
from workers.rollout.node import Node
from workers.rollout.worker import RolloutWorker, WeightSource

_ENDPOINT = re.compile(r"/instances/\d+/(\w+)$")


class Calls:
    """Requests by endpoint (`poll`, `segments`, `heartbeat`, ...), counted as they are sent; a
    node's syncs as `sync (flush)` (items: the instances it carries, counted in `items`) and
    `sync (long-poll)`."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def hook(self, request: httpx.Request) -> None:
        m = _ENDPOINT.search(request.url.path)
        name = m.group(1) if m else request.method + " " + request.url.path.rsplit("/", 1)[-1]
        items = 0
        if request.url.path.endswith("/instances/sync"):
            items = len(json.loads(request.content).get("items") or [])
            name = "sync (flush)" if items else "sync (long-poll)"
        with self.lock:
            self.counts[name] += 1
            self.counts["items"] += items

    def reset(self) -> Counter[str]:
        with self.lock:
            out, self.counts = self.counts, Counter()
            return out


def counted(base: str, token: str, calls: Calls) -> StaleFlowClient:
    c = StaleFlowClient(base, token, timeout=30)
    c.http.event_hooks["request"].append(calls.hook)
    return c


def sim_weights(client: StaleFlowClient, run: int) -> WeightSource:
    """The sim engine has no weights: a pull moves its version on (as `staleflow rollout-worker
    --engine sim` does)."""
    return lambda target: (None, target if target is not None else client.run_status(run).version)


def rewards(client: StaleFlowClient, run: int, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            tasks = client.claim(run, limit=256, wait=1.0)
            if tasks:
                client.record_rewards(run, [(t.sample_id, t.reward_attempt, 1.0) for t in tasks])
        except Exception as e:  # the run ends under us at shutdown
            if not stop.is_set():
                print("reward loop:", e, file=sys.stderr)
            time.sleep(0.2)


def feed(client: StaleFlowClient, run: int, stop: threading.Event, groups: int) -> None:
    """Keep prompts queued: `groups` at a time whenever fewer are waiting."""
    n = 0
    while not stop.is_set():
        if len(client.snapshot(run).queued) < groups:
            client.enqueue(run, [(f"p{n + i}", [1, 2, 3 + (n + i) % 50]) for i in range(groups)])
            n += groups
        stop.wait(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--max-running", type=int, default=32, help="the sim engine's slots")
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument("--time-scale", type=float, default=1.0, help="the sim engine's: <1 generates faster than real")
    ap.add_argument(
        "--instances-per-node",
        type=int,
        default=1,
        help="K: the instances run as nodes of K (workers/rollout/node.py: one sync per flush, one long-poll)",
    )
    ap.add_argument("--report-dir", type=Path, default=Path("reports"))
    args = ap.parse_args()
    report = (args.report_dir / f"worker-calls-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    url = os.environ.get("STALEFLOW_DATABASE_URL")
    pg = None
    if not url:
        pg = PrivatePostgres(report / "home", {})
        url = pg.start()
    try:
        migrate.upgrade(url)
        measure(args, url, report)
    finally:
        if pg is not None:
            pg.stop_fast()


def measure(args, url: str, report: Path) -> None:
    from api.auth import create_token
    from staleflow_db.db import make_engine

    engine = make_engine(url, pool_size=1, max_overflow=1)
    admin_token = create_token(engine, "admin")["token"]
    engine.dispose()
    group = 4
    with Cluster(report, url, env={"STALEFLOW_HOME": str(report / "home")}) as cluster:
        base = cluster.start_api()
        admin = StaleFlowClient(base, admin_token, timeout=60)
        batch = max(1, args.instances * args.max_running // group // 2)
        run = admin.create_run(
            f"worker-calls-{time.time():.0f}",
            batch_size=batch,
            group_size=group,
            eta=2,
            max_response_tokens=args.max_response,
        ).id
        tok = {r: admin.create_token(r, run).token for r in ("rollout", "reward", "trainer", "coordinator")}
        cluster.spawn("coordinator", ["coordinator", "--run", str(run)], env={"STALEFLOW_TOKEN": tok["coordinator"]})
        cluster.spawn(
            "trainer",
            ["trainer", "--run", str(run), "--sim", "--sim-overhead", "1.0", "--sim-s-per-token", "0"],
            env={"STALEFLOW_TOKEN": tok["trainer"], "STALEFLOW_API_URL": base},
        )
        stop = threading.Event()
        side = [
            threading.Thread(target=rewards, args=(StaleFlowClient(base, tok["reward"]), run, stop), daemon=True),
            threading.Thread(target=feed, args=(admin, run, stop, batch), daemon=True),
        ]
        calls = Calls()
        workers = []
        nodes: list[Node] = []
        for k in range(args.instances):
            eng = SimEngine(max_running=args.max_running, time_scale=args.time_scale)
            node = None
            if args.instances_per_node > 1:  # K instances share one client and one node
                if k % args.instances_per_node == 0:
                    nodes.append(Node(counted(base, tok["rollout"], calls), run))
                node = nodes[-1]
            client = node.client if node is not None else counted(base, tok["rollout"], calls)
            workers.append(RolloutWorker(client, run, eng, name=f"w{k}", weights=sim_weights(client, run), node=node))
        threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
        for node in nodes:
            node.start()
        for t in side + threads:
            t.start()
        time.sleep(args.warmup)
        cluster.check()
        calls.reset()
        finished0 = sum(w.stats.finished for w in workers)
        t0 = time.monotonic()
        time.sleep(args.seconds)
        got = calls.reset()
        seconds = time.monotonic() - t0
        samples = sum(w.stats.finished for w in workers) - finished0
        for w in workers:
            w.stop()
        stop.set()
        for t in threads:
            t.join(60)
        for node in nodes:
            node.close()
        admin.close()
    items = got.pop("items", 0)
    total = sum(got.values())
    per = {k: v / samples if samples else float("nan") for k, v in got.items()}
    print(f"{args.instances} instances, {seconds:.0f} s, {samples} samples finished, {total} calls by the instances")
    for name, n in sorted(got.items()):
        print(f"  {name:<18}{n:>7}{per[name]:>8.2f} per sample")
    if got.get("sync (flush)"):
        print(f"  a flush carried {items / got['sync (flush)']:.2f} of its node's {args.instances_per_node} instances")
    print(
        f"worker_calls instances={args.instances} samples={samples} "
        f"calls_per_sample={total / samples if samples else float('nan'):.2f} "
        f"heartbeats={per.get('heartbeat', 0.0):.2f} polls={per.get('poll', 0.0):.2f} "
        f"reports={per.get('segments', 0.0):.2f}"
    )


if __name__ == "__main__":
    main()
