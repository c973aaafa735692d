"""Full-lifecycle protocol throughput, next to pgbench's simple-update TPS on the same server.

    python bench/protocol.py [--url URL] [--clients 4] [--batches 1,16,128] [--seconds 10]

One scratch database is created on the server (--url, else STALEFLOW_DATABASE_URL, else the
embedded default), migrated, used for both workloads and dropped at the end.

Protocol workload: one run (B=128 groups of N=8, eta=2), --clients processes. Each client
is a rollout instance plus a reward worker; client 0 is also the trainer. A client's loop,
with b = batch size:
  route(b samples of its own groups) -> poll_work -> report(b finished segments of --tokens
  tokens) -> claim_rewards(b) -> record_rewards(b) [Occupy happens here]
  client 0: consume + publish every ready buffer.
Instances pull (heartbeat at the run's version) every 0.25 s. Prompts are enqueued and
split among the clients before the clock starts; choosing which samples to route (the
coordinator's snapshot) is not timed.

Sample transitions counted (each is one state change of one sample, in a committed call):
  routed   queued -> running      (route results ROUTED)
  reported running -> finished    (report, one finished segment each)
  claimed  finished -> scoring    (claim_rewards)
  rewarded scoring -> rewarded    (record_rewards)
  trained  rewarded -> trained    (publish: B*N samples per published buffer)
So a sample that goes all the way counts 5. Rate = sum over clients / longest client wall time.

pgbench: `pgbench -N -M prepared -c C -j C -T S` (TPC-B-like without the teller/branch
updates: one UPDATE, one SELECT, one INSERT per transaction), scale --pgbench-scale, run before
and after the protocol workloads; their mean is the denominator of every ratio.
Also printed, per transition and per pgbench transaction: the CPU of the clients and of the
database backends, and what the server wrote (WAL records and bytes, the records by kind where
pg_walinspect can be had: index inserts, row locks, updates ..., commits, rows inserted
and updated per table; `server_stats`). Unlike the rates, these barely move with the machine's
load.
The last line printed is `protocol/pgbench=<x>` for the best batch size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import uuid
from collections import deque
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pgbench import pgbench, pgbench_tps
from server_stats import BackendCPU, db_work, format_kinds, scratch_database, work_per

from staleflow_db.db import database_url, make_engine
from staleflow_db.settings import to_libpq_url

KINDS = ("routed", "reported", "claimed", "rewarded", "trained")
RUN = dict(batch_size=128, group_size=8, eta=2, max_response_tokens=4096, max_prompt_tokens=512)
RESULTS = Path(__file__).resolve().parent / "results" / "protocol.json"


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- protocol clients -----------------------------------------------------------------------


def statement_timer(engine, stats: dict) -> None:
    """--profile: wall time per SQL statement (keyed by its first words) as the client sees it:
    server work, round trip and lock waits. The run lock's wait shows up in the statement
    that takes it (`pipeline: SELECT staleflow_lock_run(...) | <the read>`)."""
    from sqlalchemy import event

    def before(conn, cursor, statement, params, context, many):
        conn.info["t0"] = time.perf_counter()

    def after(conn, cursor, statement, params, context, many):
        entry = stats.setdefault(" ".join(statement.split())[:110], [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - conn.info.pop("t0")

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)

    # the run lock and its read, a poll and its commands, a report's instances and samples go
    # to psycopg in one pipeline each, past SQLAlchemy's events (`driver.results` sends them all)
    from staleflow_db.protocol import driver

    results = driver.results

    def timed_results(conn, statements, row_factory):
        t0 = time.perf_counter()
        try:
            return results(conn, statements, row_factory)
        finally:
            key = "pipeline: " + " | ".join(" ".join(q.split())[:50] for q, _ in statements)
            entry = stats.setdefault(key[:110], [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    driver.results = timed_results


def client(
    k: int,
    url: str,
    run: int,
    samples: list[int],
    batch: int,
    seconds: float,
    tokens: int,
    barrier,
    counters,
    out,
    profile: bool = False,
) -> None:
    from sqlalchemy import text

    from staleflow_db.protocol import Protocol
    from staleflow_db.types import Report
    from workers.wire.enums import SegmentKind
    from workers.wire.types import RouteOutcome

    engine = make_engine(url, pool_size=2, max_overflow=0)
    p = Protocol(engine)
    inst = p.register_instance(run, f"bench-{k}", 0)
    statements: dict[str, list] = {}
    if profile:
        statement_timer(engine, statements)
    toks, lps = list(range(1, tokens + 1)), [-0.5] * tokens
    todo = deque(samples)
    counts = dict.fromkeys(KINDS, 0)
    calls, version, next_pull, dry, not_admitted, no_group = 0, 0, 0.0, False, 0, 0
    spent: dict[str, float] = {}  # seconds inside each operation
    B, N = RUN["batch_size"], RUN["group_size"]

    def timed(op: str, fn, *a):
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            spent[op] = spent.get(op, 0.0) + time.perf_counter() - t

    def bump(kind: str, n: int) -> None:
        counts[kind] += n
        counters[k * len(KINDS) + KINDS.index(kind)] += n

    barrier.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        if time.perf_counter() >= next_pull:  # the instance pulls the latest weights
            with engine.connect() as c:
                latest = c.execute(text("SELECT version FROM runs WHERE id = :r"), {"r": run}).scalar()
            timed("heartbeat", p.heartbeat, inst, latest)
            calls, next_pull = calls + 1, time.perf_counter() + 0.25
        picked = [todo.popleft() for _ in range(min(batch, len(todo)))]
        dry |= not picked
        if picked:
            results = timed("route", p.route, run, [(s, inst) for s in picked])
            refused = [r.sample_id for r in results if r.outcome != RouteOutcome.ROUTED]
            todo.extendleft(reversed(refused))  # not admitted yet: retry them first
            bump("routed", len(picked) - len(refused))
            not_admitted += len(refused)
            work = timed("poll_work", p.poll_work, inst, batch).work
            calls += 2
            if work:
                timed(
                    "report",
                    p.report,
                    run,
                    [
                        Report(
                            w.sample_id,
                            w.attempt,
                            w.v_traj,
                            toks,
                            lps,
                            SegmentKind.FINISHED,
                            "stop",
                            instance_id=inst,
                            route_token=w.route_token,
                        )
                        for w in work
                    ],
                )
                bump("reported", len(work))
                calls += 1
        tasks = timed("claim_rewards", p.claim_rewards, run, batch)
        calls += 1
        if tasks:
            bump("claimed", len(tasks))
            outcomes = timed(
                "record_rewards",
                p.record_rewards,
                run,
                [(t.sample_id, t.reward_attempt, float(t.sample_id % 2)) for t in tasks],
            )
            no_group += not outcomes  # completed no group: no Occupy, no buffer accounting
            bump("rewarded", len(tasks))
            calls += 1
        while k == 0:  # client 0 is the trainer: every ready buffer, in version order
            got = timed("consume", p.consume, run, version)
            calls += 1
            if got is None:
                break
            version = timed("publish", p.publish, run, version, got.consume_fence)
            bump("trained", B * N)
            calls += 1
    out.put(
        {
            "client": k,
            "elapsed": time.perf_counter() - t0,
            "cpu": time.process_time() - cpu0,
            "calls": calls,
            "dry": dry,
            "spent": spent,
            "not_admitted": not_admitted,
            "rewards_no_group": no_group,
            "statements": statements,
            **counts,
        }
    )
    engine.dispose()


def run_protocol(
    url: str, batch: int, clients: int, seconds: float, tokens: int, groups: int, profile: bool = False
) -> dict:
    from sqlalchemy import text

    from staleflow_db.protocol import Prompt, Protocol
    from staleflow_db.types import RunConfig

    engine = make_engine(url)
    p = Protocol(engine)
    run = p.create_run(f"bench-b{batch}-{uuid.uuid4().hex[:6]}", RunConfig(**RUN))
    progress(f"[b={batch}] enqueueing {groups} prompts x N={RUN['group_size']} ...")
    for start in range(0, groups, 5000):
        p.enqueue(run, [Prompt(f"p{i}", [1, 2, 3, 4, 5, 6, 7, 8]) for i in range(start, min(groups, start + 5000))])
    with engine.connect() as c:
        rows = (
            c.execute(
                text(
                    "SELECT array_agg(id ORDER BY idx) FROM samples WHERE run_id = :r"
                    " GROUP BY group_id ORDER BY group_id"
                ),
                {"r": run},
            )
            .scalars()
            .all()
        )
        c.execute(text("ANALYZE samples"))
    engine.dispose()
    shares = [[s for g in rows[k::clients] for s in g] for k in range(clients)]  # whole groups per client

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(clients + 1), ctx.Queue()
    counters = ctx.Array("q", clients * len(KINDS), lock=False)
    procs = [
        ctx.Process(
            target=client, args=(k, url, run, shares[k], batch, seconds, tokens, barrier, counters, out, profile)
        )
        for k in range(clients)
    ]
    for proc in procs:
        proc.start()
    work0 = db_work(url)
    with BackendCPU(url) as backends:
        barrier.wait()
        t0 = time.perf_counter()
        while any(proc.is_alive() for proc in procs) and out.qsize() < clients:
            time.sleep(1.0)
            done = sum(counters[:])
            progress(
                f"[b={batch}] {time.perf_counter() - t0:5.1f}s  {done:8d} transitions"
                f"  ({done / (time.perf_counter() - t0):8.0f}/s)"
            )
        reports = [out.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(30)
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"[b={batch}] a client failed: exit codes {[proc.exitcode for proc in procs]}")
    elapsed = max(r["elapsed"] for r in reports)
    counts = {kind: sum(r[kind] for r in reports) for kind in KINDS}
    total = sum(counts.values())
    work = work_per(work0, db_work(url), max(total, 1))
    # CPU per transition (µs): the clients' Python, and the database backends serving them
    work["cpu_us"] = {
        "clients": round(1e6 * sum(r["cpu"] for r in reports) / max(total, 1), 1),
        "database": round(1e6 * backends.seconds / max(total, 1), 1),
    }
    spent: dict[str, float] = {}
    statements: dict[str, list] = {}
    for r in reports:
        for op, s in r["spent"].items():
            spent[op] = spent.get(op, 0.0) + s
        for sql_text, (n, s) in r["statements"].items():
            entry = statements.setdefault(sql_text, [0, 0.0])
            entry[0] += n
            entry[1] += s
    if any(r["dry"] for r in reports):
        progress(f"[b={batch}] warning: a client ran out of prompts; raise --groups")
    return {
        "batch": batch,
        "seconds": round(elapsed, 2),
        "counts": counts,
        "transitions_per_s": total / elapsed,
        "samples_trained_per_s": counts["trained"] / elapsed,
        "calls_per_s": sum(r["calls"] for r in reports) / elapsed,
        "not_admitted": sum(r["not_admitted"] for r in reports),  # routes refused by admission control
        # what the server wrote per transition (`work_per`): load-independent, unlike the rate
        "work_per_transition": work,
        # record_rewards calls that completed no group (all others Occupy or filter one)
        "rewards_no_group": sum(r["rewards_no_group"] for r in reports),
        # share of the clients' wall time spent inside each operation (waits on the run lock included)
        "time_share": {op: round(s / (elapsed * clients), 3) for op, s in sorted(spent.items(), key=lambda x: -x[1])},
        # --profile: the statements taking most of the clients' time (share, calls, ms per call)
        "statements": [
            {"share": round(s / (elapsed * clients), 3), "calls": n, "ms": round(1000 * s / n, 2), "sql": q}
            for q, (n, s) in sorted(statements.items(), key=lambda x: -x[1][1])[:15]
        ],
    }


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--url",
        default=os.environ.get("STALEFLOW_DATABASE_URL") or None,
        help="URL of any database on the server, libpq or SQLAlchemy style (postgresql+psycopg://)"
        " (default: STALEFLOW_DATABASE_URL, else embedded)",
    )
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time per batch size")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per reported segment")
    ap.add_argument("--groups", type=int, default=0, help="prompts per batch size (default: sized to the batch)")
    ap.add_argument("--pgbench-scale", type=int, default=10)
    ap.add_argument("--pgbench-seconds", type=float, default=8.0)
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--profile", action="store_true", help="time every SQL statement; print the top ones")
    args = ap.parse_args(argv)
    # psycopg.connect and pgbench take libpq URLs only; STALEFLOW_DATABASE_URL accepts SQLAlchemy's too (docs/settings.md).
    args.url = to_libpq_url(args.url) if args.url else None
    return args


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    server_url = args.url or database_url()
    with psycopg.connect(server_url, autocommit=True) as admin:
        server = admin.execute("SELECT version()").fetchone()[0]
        settings = dict(
            admin.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN"
                " ('fsync', 'synchronous_commit', 'shared_buffers', 'max_connections')"
            ).fetchall()
        )
    progress(f"server: {server}\nsettings: {settings}")
    with scratch_database(server_url) as url:
        progress(f"scratch database: {url.rsplit('/', 1)[1]}")
        progress(f"pgbench: initialising at scale {args.pgbench_scale} ...")
        pgbench(url, ["-i", "-q", "-s", str(args.pgbench_scale)])
        progress(f"pgbench -N: {args.clients} clients, {args.pgbench_seconds:.0f}s (before) ...")
        tps0, pw = pgbench_tps(url, args.clients, args.pgbench_seconds)
        progress(f"pgbench -N: {tps0:.0f} TPS")
        rows = []
        for b in batches:
            # more than the clients can route in --seconds here: 300 + 40 b alone (940 groups at
            # batch 16) ran dry after ~7 s of 10, which understated batch 16 by a third; batch 128
            # routed 5,300 groups in 10 s on a faster day, so the queue is twice that
            groups = args.groups or max(4000, 300 + 80 * b)
            rows.append(run_protocol(url, b, args.clients, args.seconds, args.tokens, groups, args.profile))
            progress(f"[b={b}] {rows[-1]['transitions_per_s']:.0f} transitions/s")
        progress(f"pgbench -N: {args.clients} clients, {args.pgbench_seconds:.0f}s (after) ...")
        tps1, _ = pgbench_tps(url, args.clients, args.pgbench_seconds)
        progress(f"pgbench -N: {tps1:.0f} TPS")
        tps = [tps0, tps1]

    base = sum(tps) / len(tps)
    for r in rows:
        r["ratio"] = r["transitions_per_s"] / base
    best = max(rows, key=lambda r: r["transitions_per_s"] if r["batch"] > 1 else -1)

    print(f"\nserver: {server.split(',')[0]}; {settings}; {args.clients} clients; {args.tokens} tokens/segment")
    print(
        f"pgbench -N -M prepared (scale {args.pgbench_scale}): {tps[0]:.0f} TPS before, {tps[1]:.0f} after, mean {base:.0f}"
    )
    print(f"{'batch':>6} {'transitions/s':>14} {'samples trained/s':>18} {'calls/s':>9} {'ratio':>7}   counts")
    for r in rows:
        counts = " ".join(f"{k}={v}" for k, v in r["counts"].items()) + (
            f" (not admitted {r['not_admitted']}; reward calls completing no group {r['rewards_no_group']})"
        )
        print(
            f"{r['batch']:>6} {r['transitions_per_s']:>14.0f} {r['samples_trained_per_s']:>18.0f}"
            f" {r['calls_per_s']:>9.0f} {r['ratio']:>7.2f}   {counts}"
        )
    print(
        f"per pgbench -N transaction: CPU {pw['cpu_us']['clients']:.0f} µs pgbench + {pw['cpu_us']['database']:.0f} µs"
        f" database; written {pw['wal_records']:.1f} WAL records, {pw['wal_bytes']:.0f} WAL bytes,"
        f" {pw['commits']:.2f} commits"
    )
    for r in rows:
        w = r["work_per_transition"]
        written = ", ".join(
            f"{t} {v['ins']:.2f} ins / {v['upd']:.2f} upd"
            for t, v in sorted(w["rows"].items())
            if v["ins"] + v["upd"] >= 0.005
        )
        cpu = w["cpu_us"]
        print(
            f"  b={r['batch']}: per transition: CPU {cpu['clients']:.0f} µs clients + {cpu['database']:.0f} µs database"
            f" ({(cpu['clients'] + cpu['database']) / max(sum(pw['cpu_us'].values()), 1e-9):.2f}x a pgbench transaction's);"
            f" written {w['wal_records']:.1f} WAL records"
            f" ({w['wal_records'] / max(pw['wal_records'], 1e-9):.1f}x a pgbench transaction's),"
            f" {w['wal_bytes']:.0f} WAL bytes, {w['commits']:.3f} commits; rows: {written}"
        )
        if w.get("wal_kinds"):
            print(
                f"  b={r['batch']}: WAL records per transition: "
                + format_kinds(w["wal_kinds"])
                + f" (pgbench: {format_kinds(pw.get('wal_kinds', {}))})"
            )
    for r in rows:
        print(
            f"  b={r['batch']}: share of client time per call: "
            + ", ".join(f"{op} {share:.0%}" for op, share in r["time_share"].items())
        )
        for st in r["statements"][:10]:
            print(f"      {st['share']:5.1%} {st['calls']:6d}x {st['ms']:7.2f} ms  {st['sql'][:90]}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "server": server,
                "settings": settings,
                "clients": args.clients,
                "tokens_per_segment": args.tokens,
                "run_config": RUN,
                "pgbench": {
                    "mode": "-N -M prepared",
                    "scale": args.pgbench_scale,
                    "seconds": args.pgbench_seconds,
                    "tps": tps,
                    "mean_tps": base,
                    "work_per_transaction": pw,  # of the run before the protocol workloads
                },
                "protocol": rows,
                "best_batch": best["batch"],
                "ratio": best["ratio"],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"protocol/pgbench={best['ratio']:.2f}")


if __name__ == "__main__":
    main()
