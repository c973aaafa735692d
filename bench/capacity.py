"""Capacity: the most rollout instances one database primary serves within the service level,
found by ramping Locust-driven simulated instances against N API replicas.

Each step makes a fresh run (tokens per role, a batch the size of the samples in flight), starts
`--processes` Locust load processes (gevent users of bench/capacity_users.py; the first also runs
the coordinator, the trainer and the reward workers) and measures a window after a warm-up.
The instances follow the real rollout worker's cadence at the sample rate the cost model gives
the set-up (`--setup`, workers/sim/setups.py): per instance `slots` samples held (the engine's
running count: min(max_running, KV capacity / mean context)), each decoding at T(n, kv)/n
tokens/s, so partial segments carry real token counts. `--turns K` makes samples agentic: K
turns each, every turn routed, generated and reported, an observation between turns. The
reward workers linger `--claim-linger` seconds after a claim that took less than their batch,
as `staleflow reward-worker` does.

Service level of a step: 0 errors, p99 <= 250 ms on every endpoint that is not a long-poll,
command (pull) delivery p99 <= 250 ms when pulls happened in the window, no lease lapsed (no
call of an instance refused with 409). The ramp doubles from `--start` until a step fails (or, with `--keep-going`, on) up to
`--max-instances`.

Per step: instances, calls/s, calls per finished sample, p50/p99 per endpoint, CPU per call of
the PostgreSQL processes, of the API replicas and of the load generator (psutil, microseconds
per call), the server's CPU per finished sample (database and API: the work itself, which bounds
a step once its calls coalesce under load), the database's connections (pg_stat_activity), and
the WAL the server wrote per generated token (pg_current_wal_lsn over the window; tokens
generated: those reported plus what the held samples had not yet reported at the window's end,
less at its start; random token ids and log-probs, as incompressible as real ones). The load generator shares the
machine's cores with the server: its CPU is reported so the bound is visible.

After the ramp, `pgbench -N` runs on the same server and cores for `--pgbench-seconds` (in a
scratch database, the replicas idle): each step's calls/s is also given as a ratio to its TPS,
the database's own transaction rate.

`--pgbouncer POOL`: the replicas reach the server through a local PgBouncer in transaction mode
(bench/pooler.py; Debian's `pgbouncer`) with POOL server connections, their LISTEN straight to
the server, as deploy/ runs them; below PgBouncer 1.21 with prepared statements off. Its CPU is
reported per call beside the server's.

    python bench/capacity.py [--replicas 2] [--processes 2] [--setup qwen_14b] [--turns 1]
                             [--start 16] [--max-instances 1024] [--seconds 45] [--pgbouncer POOL]
                             [--quick]

`STALEFLOW_DATABASE_URL` set: that server (migrated here) instead of a private embedded one.
Last line: `capacity instances=N calls_per_s=C p99_ms=P db_us_per_call=D api_us_per_call=A`
for the largest step within the service level (instances=0 and the first step's figures if none).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

import httpx
import numpy as np
import psutil
import psycopg
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import PrivatePostgres
from bench.pgbench import pgbench, pgbench_tps
from bench.pooler import local_pgbouncer, pgbouncer_binary
from bench.server_stats import scratch_database
from staleflow_cli.enqueue import CHUNK as ENQUEUE_CHUNK
from staleflow_cli.launch import Cluster
from staleflow_db import migrate
from staleflow_db.settings import to_libpq_url
from workers.client import StaleFlowClient
from workers.reward.worker import CLAIM_LINGER_S
from workers.rollout.worker import CHECKPOINT_EVERY_S, CHECKPOINT_TOKENS, FINISH_SLACK_MAX_S, FINISH_SLACK_SHARE
from workers.sim.setups import get_setup

SLO_MS = 250.0
LONG_POLL = "long-poll"
# the calls of the rollout instances (one node's syncs carry several instances' calls)
INSTANCE_CALLS = ("register", "poll (long-poll)", "report", "heartbeat", "sync (flush)", "sync (long-poll)")


def cadence(setup_name: str, slots: int | None, turns: int) -> dict:
    """The per-instance rates the set-up's cost model gives (see the module docstring)."""
    s = get_setup(setup_name)
    w = s.workload
    draws = np.minimum(w.max_response, w.median * np.exp(w.sigma * np.random.default_rng(0).standard_normal(100_000)))
    mean = float(draws.mean())
    context = w.prompt_median + mean / 2
    n = min(s.max_running, s.kv_capacity / context)
    throughput = s.cost.throughput(n, n * context)
    held = slots or max(1, round(n))
    return dict(
        setup=s.name,
        group_size=s.group_size,
        engine_running=round(n),
        slots=held,
        kv_capacity=s.kv_capacity,
        tokens_per_s=throughput / n,  # per sample
        sample_rate=throughput / mean,  # finished samples per second per instance
        max_tokens=w.max_response,
        turns=turns,
        prompt_tokens=w.prompt_median,
        # the worker's checkpoint: due when a held stretch has CHECKPOINT_TOKENS unsent tokens
        # (a sample held since the last one has rate x time) or CHECKPOINT_EVERY_S passed
        checkpoint_s=min(CHECKPOINT_EVERY_S, CHECKPOINT_TOKENS / (throughput / n)),
    )


class CPU:
    """CPU seconds (user + system) of a set of processes and their children, sampled every
    0.5 s so processes that exit keep what they used; `seconds` over the window."""

    def __init__(self, roots):
        self.roots = roots  # () -> pids
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def sample(self) -> None:
        for pid in self.roots():
            try:
                root = psutil.Process(pid)
                for p in [root, *root.children(recursive=True)]:
                    t = p.cpu_times()
                    self.first.setdefault(p.pid, t.user + t.system)
                    self.last[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def reset(self) -> None:
        self.first, self.last = {}, {}
        self.sample()

    @property
    def seconds(self) -> float:
        return sum(self.last[p] - self.first[p] for p in self.last)


def pct(hist: Counter, q: float) -> float:
    """Percentile (ms) of a Locust response-time histogram {ms: count}."""
    total = sum(hist.values())
    if not total:
        return 0.0
    seen = 0
    for ms in sorted(hist):
        seen += hist[ms]
        if seen >= q * total:
            return float(ms)
    return float(max(hist))


def run_step(args, cad: dict, bases: list[str], admin: StaleFlowClient, report: Path, instances: int, cpus) -> dict:
    g = cad["group_size"]
    batch = max(1, math.ceil(instances * cad["slots"] / g))
    run = admin.create_run(
        f"capacity-{instances}",
        batch_size=batch,
        group_size=g,
        eta=args.eta,
        max_response_tokens=cad["max_tokens"],
        max_prompt_tokens=max(1024, cad["prompt_tokens"]),
    ).id
    tokens = {r: admin.create_token(r, run).token for r in ("rollout", "reward", "trainer", "coordinator")}
    k_node = args.instances_per_node
    nodes = math.ceil(instances / k_node)  # users: one per node (one per instance when K = 1)
    procs = max(1, min(args.processes, nodes))
    now = time.time()
    start_at = now + args.warmup
    end_at = start_at + args.seconds
    children, outs = [], []
    step_dir = report / f"step-{instances}"
    step_dir.mkdir(parents=True, exist_ok=True)
    for k in range(procs):
        cfg = dict(
            cad,
            hosts=bases,
            tokens=tokens,
            run=run,
            instances=(nodes // procs + (1 if k < nodes % procs else 0)) * k_node,
            per_node=k_node,
            node_report_s=args.node_report_s,
            control=k == 0,
            rewarders=args.reward_workers,
            claim_linger_s=args.claim_linger,
            lease_s=15.0,
            report_s=0.05,
            finish_slack_max_s=args.finish_slack,
            finish_slack_share=FINISH_SLACK_SHARE,
            heartbeat_s=1.0,  # the least time between two snapshots a report carries
            checkpoint_s=args.checkpoint_s or cad["checkpoint_s"],
            wire=args.wire,
            snapshot_every_s=5.0,  # the worker's default: a third of the lease
            poll_wait_s=5.0,
            observation_tokens=32,  # an environment's answer between turns
            coordinator_s=0.1,  # the staleflow policy's cycle_period
            enqueue_groups=max(4, math.ceil(instances * cad["slots"] / g / 4)),
            enqueue_chunk=ENQUEUE_CHUNK,  # prompts a call, as `staleflow enqueue` sends them
            train_s=args.train_seconds,
            spawn_s=args.warmup / 2,
            start_at=start_at,
            end_at=end_at,
        )
        (step_dir / f"cfg-{k}.json").write_text(json.dumps(cfg))
        outs.append(step_dir / f"out-{k}.json")
        log = open(step_dir / f"locust-{k}.log", "wb")
        children.append(
            subprocess.Popen(
                [sys.executable, str(_HERE / "capacity_users.py"), str(step_dir / f"cfg-{k}.json"), str(outs[-1])],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()
    load_cpu = CPU(lambda: [c.pid for c in children])
    conns: list[int] = []
    # never prepared: through a transaction pooler (PgBouncer) the next statement may find another server session
    with psycopg.connect(args.url, autocommit=True, application_name="sf-capacity", prepare_threshold=None) as db:
        while time.time() < start_at:
            time.sleep(min(5.0, max(0.0, start_at - time.time())))
            print(f"  {instances} instances: warming up, {start_at - time.time():3.0f} s", file=sys.stderr)
        for c in (*cpus, load_cpu):
            c.reset()
        tx_from = transaction_cpu(bases)
        wal_from = db.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        while time.time() < end_at:
            time.sleep(min(1.0, max(0.0, end_at - time.time())))
            for c in (*cpus, load_cpu):
                c.sample()
            conns.append(
                db.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'").fetchone()[0]
            )
            left = end_at - time.time()
            if len(conns) % 5 == 0:
                print(
                    f"  {instances} instances: measuring, {left:3.0f} s left; connections {conns[-1]}, "
                    f"CPU so far db {cpus[0].seconds:.1f} s, api {cpus[1].seconds:.1f} s, load {load_cpu.seconds:.1f} s",
                    file=sys.stderr,
                )
        wal = float(db.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (wal_from,)).fetchone()[0])
        tx = transaction_cpu(bases)
        tx.subtract(tx_from)
    for c in children:
        try:
            c.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(c.pid, signal.SIGKILL)
            c.wait()
    got = [json.loads(o.read_text()) for o in outs if o.exists()]
    if len(got) < len(children):
        raise SystemExit(f"a load process failed: see {step_dir}/locust-*.log")
    return summarize(nodes * k_node, got, cpus, load_cpu, conns, wal, tx)


def transaction_cpu(bases: list[str]) -> Counter:
    """Per protocol operation, summed over the replicas' /metrics: its transactions and the CPU
    seconds of the threads that ran them (`staleflow_protocol_transaction_cpu_seconds_total`)."""
    got: Counter = Counter()
    for base in bases:
        for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
            for sample in family.samples:
                if sample.name == "staleflow_protocol_transaction_seconds_count":
                    got[(sample.labels["operation"], "n")] += sample.value
                elif sample.name == "staleflow_protocol_transaction_cpu_seconds_total":
                    got[(sample.labels["operation"], "cpu")] += sample.value
    return got


def summarize(instances: int, got: list[dict], cpus, load_cpu: CPU, conns: list[int], wal: float, tx: Counter) -> dict:
    seconds = max(o["seconds"] for o in got)
    per: dict[str, dict] = {}
    for o in got:
        for name, e in o["stats"].items():
            d = per.setdefault(name, {"calls": 0, "failures": 0, "ms": Counter()})
            d["calls"] += e["calls"]
            d["failures"] += e["failures"]
            d["ms"].update({int(k): v for k, v in e["ms"].items()})
    pulls = {int(v): t for o in got for v, t in o["pulls"].items()}
    delivery = Counter(round((at - pulls[v]) * 1000) for o in got for v, _i, at in o["deliveries"] if v in pulls)
    calls = sum(d["calls"] for d in per.values())
    instance_calls = sum(per[n]["calls"] for n in INSTANCE_CALLS if n in per)
    short = Counter()
    for name, d in per.items():
        if LONG_POLL not in name:
            short.update(d["ms"])
    finished = sum(o["finished"] for o in got)
    tokens = sum(o["tokens"] for o in got)
    generated = sum(o["generated"] for o in got)
    errors = sum(d["failures"] for d in per.values()) + sum(o["crashes"] for o in got)
    lapses = sum(o["lapses"] for o in got)
    worst = max((pct(d["ms"], 0.99) for n, d in per.items() if LONG_POLL not in n), default=0.0)
    deliver_p99 = pct(delivery, 0.99) if delivery else None
    ok = (
        finished > 0
        and errors == 0
        and lapses == 0
        and worst <= SLO_MS
        and (deliver_p99 is None or deliver_p99 <= SLO_MS)
    )
    return dict(
        instances=instances,
        seconds=seconds,
        calls=calls,
        calls_per_s=calls / seconds,
        finished=finished,
        calls_per_sample=calls / finished if finished else float("nan"),
        instance_calls_per_sample=instance_calls / finished if finished else float("nan"),
        instance_calls_per_s=instance_calls / (instances * seconds),  # per instance-second
        p99_ms=pct(short, 0.99),
        worst_p99_ms=worst,
        delivery_p99_ms=deliver_p99,
        deliveries=sum(delivery.values()),
        errors=errors,
        lapses=lapses,
        db_us=cpus[0].seconds / calls * 1e6 if calls else 0.0,
        api_us=cpus[1].seconds / calls * 1e6 if calls else 0.0,
        load_us=load_cpu.seconds / calls * 1e6 if calls else 0.0,
        pooler_us=cpus[2].seconds / calls * 1e6 if calls and len(cpus) > 2 else None,
        db_cores=cpus[0].seconds / seconds,
        api_cores=cpus[1].seconds / seconds,
        load_cores=load_cpu.seconds / seconds,
        # the work itself, whatever the calls it took: what bounds a step once calls coalesce
        db_ms_per_sample=cpus[0].seconds / finished * 1e3 if finished else float("nan"),
        api_ms_per_sample=cpus[1].seconds / finished * 1e3 if finished else float("nan"),
        connections=max(conns) if conns else 0,
        tokens=tokens,  # generated tokens reported in the window
        generated=generated,  # generated in the window: reported + (held unsent at its end - at its start)
        wal_bytes=wal,  # WAL the server wrote in the window (every writer: the measured run alone)
        wal_per_token=wal / generated if generated > 0 else float("nan"),
        endpoints={
            n: (d["calls"], d["failures"], pct(d["ms"], 0.5), pct(d["ms"], 0.99)) for n, d in sorted(per.items())
        },
        samples=[e for o in got for e in o["errors"]][:5],
        # per operation: transactions in the window and their threads' CPU seconds (the API's
        # CPU outside them is HTTP, validation and serialisation on the event loop)
        transactions={
            op: (int(tx[(op, "n")]), tx[(op, "cpu")]) for op in sorted({op for op, _ in tx}) if tx[(op, "n")] > 0
        },
        ok=ok,
    )


def show(step: dict) -> None:
    s = step
    deliver = (
        f"{s['delivery_p99_ms']:.0f} ms ({s['deliveries']} pulls)"
        if s["delivery_p99_ms"] is not None
        else "none in window"
    )
    print(
        f"\n{s['instances']} instances, {s['seconds']:.0f} s: {s['calls_per_s']:,.0f} calls/s, "
        f"{s['calls_per_sample']:.1f} calls per finished sample ({s['instance_calls_per_sample']:.1f} by the instances, "
        f"{s['instance_calls_per_s']:.2f} per instance-second), "
        f"errors {s['errors']}, lapses {s['lapses']}, command delivery p99 {deliver}, "
        f"connections {s['connections']} -> {'within' if s['ok'] else 'OUTSIDE'} the service level"
    )
    print(
        f"  CPU per call: db {s['db_us']:.0f} us, api {s['api_us']:.0f} us, load generator {s['load_us']:.0f} us "
        f"(cores busy: db {s['db_cores']:.2f}, api {s['api_cores']:.2f}, load {s['load_cores']:.2f})"
    )
    if s.get("pooler_us") is not None:
        print(f"  CPU per call of the PgBouncer between the replicas and the server: {s['pooler_us']:.0f} us")
    print(
        f"  server CPU per finished sample ({s['finished'] / s['seconds']:.1f}/s): db {s['db_ms_per_sample']:.1f} ms, "
        f"api {s['api_ms_per_sample']:.1f} ms"
    )
    print(
        f"  tokens generated {s['generated']:,.0f} ({s['generated'] / s['seconds']:,.0f}/s; reported {s['tokens']:,}), "
        f"WAL {s['wal_bytes'] / 1e6:,.1f} MB: {s['wal_per_token']:.1f} WAL bytes per generated token"
    )
    api_s = s["api_cores"] * s["seconds"]
    in_tx = sum(cpu for _, cpu in s["transactions"].values())
    if s["transactions"] and api_s > 0:
        print(
            f"  API CPU in protocol transactions {100 * in_tx / api_s:.0f}% (the threads that ran them), "
            f"the rest {100 * (1 - in_tx / api_s):.0f}% (HTTP, validation, serialisation):"
        )
        ranked = sorted(s["transactions"].items(), key=lambda kv: -kv[1][1])
        for op, (n, cpu) in ranked[:8]:
            print(
                f"    {op:<26}{n:>7} transactions {cpu / n * 1e6:>7.0f} us each, {100 * cpu / api_s:>4.1f}% of the API's CPU"
            )
    print(f"  {'endpoint':<22}{'calls':>8}{'errors':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for name, (calls, fails, p50, p99) in s["endpoints"].items():
        print(f"  {name:<22}{calls:>8}{fails:>8}{p50:>9.0f}{p99:>9.0f}")
    for e in s["samples"]:
        print("  error:", e)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2, help="API replicas (`staleflow serve` processes)")
    ap.add_argument("--processes", type=int, default=2, help="Locust load processes (gevent users in each)")
    ap.add_argument(
        "--setup", default=None, help="set-up whose cost model gives the cadence (qwen_14b; --quick: short_many)"
    )
    ap.add_argument(
        "--turns", type=int, default=1, help="turns per sample (agentic: routed again per turn, an observation between)"
    )
    ap.add_argument("--slots", type=int, default=None, help="samples held per instance (default: the engine's)")
    ap.add_argument("--start", type=int, default=16)
    ap.add_argument("--max-instances", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=45, help="measured window per step")
    ap.add_argument("--warmup", type=float, default=20, help="seconds of each step before the window")
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--reward-workers", type=int, default=2)
    ap.add_argument(
        "--claim-linger",
        type=float,
        default=CLAIM_LINGER_S,
        help="a reward worker's wait after a claim that took less than its batch (the worker's --linger; 0: none)",
    )
    ap.add_argument("--train-seconds", type=float, default=5.0)
    ap.add_argument("--pool", type=int, default=20, help="STALEFLOW_POOL_SIZE of each replica")
    ap.add_argument("--overflow", type=int, default=10, help="STALEFLOW_MAX_OVERFLOW of each replica")
    ap.add_argument(
        "--quick", action="store_true", help="smoke test: 4 then 8 instances of short_many, 1 replica, ~1 min"
    )
    ap.add_argument(
        "--instances-per-node",
        type=int,
        default=1,
        help="K: each load user is a node of K instances (workers/rollout/node.py: one sync per flush, one long-poll)",
    )
    ap.add_argument(
        "--node-report-s",
        type=float,
        default=0.05,
        help="a node's report timer (its instances' pending reports wait at most this long; the worker's is 0.05)",
    )
    ap.add_argument(
        "--finish-slack",
        type=float,
        default=FINISH_SLACK_MAX_S,
        help="most seconds a finished sample's report waits for company (at most 1%% of its decode time; "
        "the worker's --finish-slack); 0: at the report timer",
    )
    ap.add_argument(
        "--checkpoint-s",
        type=float,
        default=None,
        help="every held sample as a partial segment this often (default: the worker's rule at the cost model's "
        f"decode rate, {CHECKPOINT_TOKENS} tokens or {CHECKPOINT_EVERY_S:g} s; the code before 5 s)",
    )
    ap.add_argument(
        "--wire",
        choices=("packed", "lists"),
        default="packed",
        help="reports' token ids and log-probs as the worker's client sends them (packed) or as JSON lists",
    )
    ap.add_argument("--keep-going", action="store_true", help="ramp on past a step outside the service level")
    ap.add_argument(
        "--pgbench-seconds",
        type=float,
        default=10.0,
        help="pgbench -N on the same server after the ramp, the baseline of calls/s (0: none)",
    )
    ap.add_argument("--pgbench-clients", type=int, default=8)
    ap.add_argument(
        "--pgbouncer",
        type=int,
        default=0,
        metavar="POOL",
        help="the replicas through a local PgBouncer in transaction mode with POOL server connections "
        "(their LISTEN straight to the server; prepared statements off below PgBouncer 1.21); 0: direct",
    )
    ap.add_argument("--report-dir", type=Path, default=Path("reports"))
    args = ap.parse_args()
    if args.quick:
        args.replicas, args.processes, args.start, args.max_instances = 1, 1, 4, 8
        args.seconds, args.warmup, args.slots = 15, 10, args.slots or 8
        args.pgbench_seconds = min(args.pgbench_seconds, 2.0)
        args.train_seconds = 1.0
        args.setup = args.setup or "short_many"  # short samples: versions, so pulls, within the window
    args.setup = args.setup or "qwen_14b"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = (args.report_dir / f"capacity-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    cad = cadence(args.setup, args.slots, args.turns)
    print(
        f"cadence ({cad['setup']}): {cad['slots']} samples held per instance (engine runs {cad['engine_running']}), "
        f"{cad['tokens_per_s']:.1f} tokens/s each, {cad['sample_rate']:.3f} samples/s per instance, "
        f"{cad['turns']} turn(s) per sample; reports when a segment ends (coalesced over 50 ms), checkpoints every "
        f"{args.checkpoint_s or cad['checkpoint_s']:.1f} s "
        "(riding a report once 80% due), long-poll 5 s, polls and reports renew the lease, a heartbeat "
        "only when no snapshot went for 5 s"
        + (
            f"; nodes of {args.instances_per_node} instances: one sync per flush, one long-poll for all"
            if args.instances_per_node > 1
            else ""
        )
    )
    print(
        f"load: {args.processes} Locust process(es) of gevent users on this machine's {os.cpu_count()} cores, "
        f"shared with {args.replicas} API replica(s) and PostgreSQL (load average now "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})"
    )
    url = os.environ.get("STALEFLOW_DATABASE_URL")
    pg = None
    if not url:
        pg = PrivatePostgres(report / "home", {"max_connections": "200"})
        url = pg.start()
    args.url = url
    baseline = None
    try:
        migrate.upgrade(url)
        steps = ramp(args, cad, report)
        baseline = pgbench_baseline(url, args.pgbench_clients, args.pgbench_seconds)
    finally:
        if pg is not None:
            pg.stop_fast()
    print(
        f"\n{'instances':>9}{'calls/s':>9}{'calls/sample':>13}{'inst/s':>7}{'p99 ms':>8}{'worst p99':>10}{'pull p99':>9}"
        f"{'db us':>7}{'api us':>7}{'load us':>8}{'ms/sample':>10}{'conns':>6}{'errors':>7}  ok"
    )
    for s in steps:
        d = "-" if s["delivery_p99_ms"] is None else f"{s['delivery_p99_ms']:.0f}"
        print(
            f"{s['instances']:>9}{s['calls_per_s']:>9.0f}{s['calls_per_sample']:>13.1f}"
            f"{s['instance_calls_per_s']:>7.2f}{s['p99_ms']:>8.0f}"
            f"{s['worst_p99_ms']:>10.0f}{d:>9}{s['db_us']:>7.0f}{s['api_us']:>7.0f}{s['load_us']:>8.0f}"
            f"{s['db_ms_per_sample'] + s['api_ms_per_sample']:>10.1f}"
            f"{s['connections']:>6}{s['errors']:>7}  {'yes' if s['ok'] else 'no'}"
        )
    if baseline is not None:
        tps, cpu = baseline
        tx_us = cpu["clients"] + cpu["database"]
        for s in steps:
            s["pgbench_tps"], s["pgbench_cpu_us"] = tps, cpu
            s["calls_per_pgbench_tx"] = s["calls_per_s"] / tps
            s["call_cpu_per_pgbench_tx"] = (s["db_us"] + s["api_us"]) / tx_us
        print(
            f"pgbench -N on the same server ({args.pgbench_clients} clients, {args.pgbench_seconds:g} s, after the "
            f"ramp): {tps:,.0f} TPS at {cpu['clients']:.0f} + {cpu['database']:.0f} us of CPU a transaction "
            "(clients + database); per step, calls/s per pgbench TPS and the server's CPU a call in pgbench "
            "transactions: "
            + ", ".join(
                f"{s['instances']} instances {s['calls_per_pgbench_tx']:.3f}, {s['call_cpu_per_pgbench_tx']:.1f}"
                for s in steps
            )
        )
    report.mkdir(parents=True, exist_ok=True)
    (report / "capacity.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cadence": cad, "steps": steps}, indent=1)
    )
    print(f"steps in {report / 'capacity.json'}")
    passed = [s for s in steps if s["ok"]]
    best = passed[-1] if passed else steps[0]
    print(
        f"capacity instances={best['instances'] if passed else 0} calls_per_s={best['calls_per_s']:.0f} "
        f"p99_ms={best['p99_ms']:.0f} db_us_per_call={best['db_us']:.0f} api_us_per_call={best['api_us']:.0f}"
    )


def pgbench_baseline(url: str, clients: int, seconds: float) -> tuple[float, dict] | None:
    """`pgbench -N` on the server of `url`, in a scratch database (scale 10): its TPS and its CPU
    per transaction (`cpu_us`: clients, database); None for 0 s or when it cannot run (the ramp's
    figures stand without it). Behind a transaction pooler (the replicas' URL through PgBouncer)
    it runs on the server itself, by the LISTEN URL, which goes there: pgbench's prepared
    statements do not survive a pooler that moves them between server connections."""
    if seconds <= 0:
        return None
    server = to_libpq_url(os.environ.get("STALEFLOW_LISTEN_DATABASE_URL") or url)  # the server, not a pooler
    try:
        with scratch_database(server, "sf_capacity_pgbench") as scratch:
            pgbench(scratch, ["-i", "-q", "-s", "10"])
            tps, work = pgbench_tps(scratch, clients, seconds)
            return tps, work["cpu_us"]
    except (SystemExit, psycopg.Error) as e:
        print(f"pgbench baseline not measured: {e}")
        return None


def ramp(args, cad: dict, report: Path) -> list[dict]:
    """The steps, the replicas straight to the server or through a local PgBouncer."""
    if not args.pgbouncer:
        return ramp_on(args, cad, report, args.url, {}, None)
    if pgbouncer_binary() is None:
        raise SystemExit("--pgbouncer: pgbouncer is not installed (apt-get install -y pgbouncer)")
    server = to_libpq_url(args.url)
    with local_pgbouncer(server, args.pgbouncer) as bouncer:
        print(
            f"replicas through PgBouncer {'.'.join(map(str, bouncer.version))} (transaction mode, "
            f"{args.pgbouncer} server connections), their LISTEN straight to the server, prepared statements "
            f"{'kept' if bouncer.prepared else 'off'}"
        )
        env = {"STALEFLOW_LISTEN_DATABASE_URL": server}
        if not bouncer.prepared:
            env["STALEFLOW_PREPARED_STATEMENTS"] = "0"
        return ramp_on(args, cad, report, bouncer.url, env, bouncer.pid)


def ramp_on(
    args, cad: dict, report: Path, replicas_url: str, replicas_env: dict[str, str], pooler_pid: int | None
) -> list[dict]:
    from api.auth import create_token
    from staleflow_db.db import make_engine

    engine = make_engine(args.url, pool_size=1, max_overflow=1)
    token = create_token(engine, "admin")["token"]
    engine.dispose()
    env = {
        "STALEFLOW_POOL_SIZE": str(args.pool),
        "STALEFLOW_MAX_OVERFLOW": str(args.overflow),
        "STALEFLOW_HOME": str(report / "home"),
        **replicas_env,
    }
    with psycopg.connect(args.url, autocommit=True) as c:  # the backend lives while connected
        backend = c.execute("SELECT pg_backend_pid()").fetchone()[0]
        postmaster = psutil.Process(backend).parent().pid  # the server on this machine
    steps: list[dict] = []
    with Cluster(report, replicas_url, env=env) as cluster:
        bases = [cluster.start_api() for _ in range(args.replicas)]
        api_pids = [p.popen.pid for p in cluster.procs]
        cpus = (CPU(lambda: [postmaster]), CPU(lambda: api_pids)) + ((CPU(lambda: [pooler_pid]),) if pooler_pid else ())
        admin = StaleFlowClient(bases, token, timeout=60)
        n = args.start
        while n <= args.max_instances:
            print(f"step: {n} instances against {args.replicas} replica(s)", file=sys.stderr)
            cluster.check()
            step = run_step(args, cad, bases, admin, report, n, cpus)
            show(step)
            steps.append(step)
            if not step["ok"] and not args.keep_going:
                break
            n *= 2
        admin.close()
    return steps


if __name__ == "__main__":
    sys.exit(main())
