"""Storage per generated token: what a run's rollouts cost the database on disk and in WAL.

    python bench/storage.py [--tokens 1500000] [--warmup 500000] [--url URL] [--offload [STORE_URL]]

A realistic workload runs in-process through the real protocol (`staleflow_db.protocol`) on a
private embedded PostgreSQL (its WAL is this workload's alone; --url: a scratch database on
that server instead, whose WAL other databases share): one run (B=16 groups of N=8, eta=2),
4 rollout instances. Each sample is generated in several segments (a checkpoint every ~128
tokens: PARTIAL reports), a quarter of them interrupted once (INTERRUPTED, routed again and
continued from the prefix), then FINISHED; then claimed, rewarded, trained (consume + publish).
Token ids are random in a 150k vocabulary and log-probs random floats (nothing compressible
that real ones would not have). It stops after the first published step past --tokens
generated tokens. The figures are the growth from the first published step past --warmup
generated tokens to the end, per token generated in between: the steady state of a long run
(in-flight samples, and with --offload the payloads not yet offloaded and the space a vacuum
has yet to free, are a fixed amount that the warm-up already holds).

--offload: after each published step, the run's finished segments' payloads move to the
payload store (`staleflow_db.payload_store`; default a temporary `file://` folder) and the
segments table is vacuumed every 4 steps, so freed space is reused as in a long run.

Reported, per generated token: the segments table (heap + TOAST), its indexes, the events
table (with its indexes), the whole database's growth, and the WAL written
(pg_current_wal_lsn difference); and the database's growth per million generated tokens.
Last line: `storage bytes_per_token=B table=T index=I wal=W db_mb_per_million_tokens=M`
(B the database's growth per token).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO / "bench"]
if str(_REPO) not in sys.path:
    sys.path.append(str(_REPO))

import psycopg
from sqlalchemy import text

from staleflow_db.db import make_engine
from staleflow_db.settings import to_libpq_url

RUN: dict[str, int] = dict(batch_size=16, group_size=8, eta=2, max_response_tokens=4096, max_prompt_tokens=512)
INSTANCES = 4
CHECKPOINT = 128  # tokens per PARTIAL report
VOCAB = 150_000


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sizes(url: str) -> dict[str, int]:
    with psycopg.connect(to_libpq_url(url), autocommit=True) as c:
        row = c.execute(
            "SELECT pg_table_size('segments'), pg_indexes_size('segments'), pg_total_relation_size('events'),"
            " pg_database_size(current_database()), pg_current_wal_lsn() - '0/0'::pg_lsn"
        ).fetchone()
    assert row is not None
    return dict(zip(("table", "index", "events", "db", "wal"), (int(v) for v in row), strict=True))


def workload(url: str, tokens: int, warmup: int, seed: int, offload_store: str | None) -> dict[str, Any]:
    from staleflow_db.protocol import Prompt, Protocol
    from staleflow_db.types import Report, RunConfig
    from workers.wire.enums import SegmentKind

    rng = random.Random(seed)
    engine = make_engine(url)
    p = Protocol(engine)
    run = p.create_run(f"storage-{seed}-{int(time.time())}", RunConfig(**RUN))  # type: ignore[arg-type]
    B, N = RUN["batch_size"], RUN["group_size"]
    groups_needed = int(tokens / (N * 700)) + 4 * B
    p.enqueue(run, [Prompt(f"p{i}", [rng.randrange(VOCAB) for _ in range(64)]) for i in range(groups_needed)])
    # a long lease: on a loaded machine one pass over the instances can outlast the default 30 s
    insts = [p.register_instance(run, f"storage-{k}", 0, lease_seconds=3600) for k in range(INSTANCES)]
    target: dict[int, int] = {}  # sample id -> its response length
    interrupt_at: dict[int, int] = {}  # sample id -> where it is interrupted once
    generated, version, steps, spent = 0, 0, 0, 0.0
    start: tuple[int, dict[str, int]] | None = None  # (generated, sizes) after the warm-up
    store = None
    if offload_store is not None:
        from staleflow_db.payload_store import offload_run, open_store

        store = open_store(offload_store)
    with engine.connect() as c:
        c.execute(text("ANALYZE samples"))
        c.commit()
    while True:
        for inst in insts:
            p.heartbeat(inst, version, lease_seconds=3600)
        with engine.connect() as c:
            queued = (
                c.execute(
                    text(
                        "SELECT id FROM samples WHERE run_id = :r AND state = 'queued' ORDER BY group_id, idx LIMIT :n"
                    ),
                    {"r": run, "n": B * N},
                )
                .scalars()
                .all()
            )
        if queued:
            p.route(run, [(s, insts[i % INSTANCES]) for i, s in enumerate(queued)])  # refused ones stay queued
        for inst in insts:
            for w in p.poll_work(inst, 1000).work:
                sid = w.sample_id
                total = target.setdefault(sid, rng.randint(100, 1300))
                if sid not in interrupt_at:
                    interrupt_at[sid] = rng.randint(1, total - 1) if rng.random() < 0.25 else -1
                done = len(w.prefix_tokens)
                reports = []
                while done < total:
                    n = min(CHECKPOINT, total - done)
                    kind = SegmentKind.PARTIAL
                    if done < interrupt_at[sid] <= done + n:
                        n, kind = interrupt_at[sid] - done, SegmentKind.INTERRUPTED
                    elif done + n == total:
                        kind = SegmentKind.FINISHED
                    reports.append((n, kind))
                    done += n
                    if kind != SegmentKind.PARTIAL:
                        break
                for n, kind in reports:
                    t0 = time.process_time()
                    p.report(
                        run,
                        [
                            Report(
                                sid,
                                w.attempt,
                                version,
                                [rng.randrange(VOCAB) for _ in range(n)],
                                [-rng.expovariate(2.0) for _ in range(n)],
                                kind,
                                "stop" if kind == SegmentKind.FINISHED else None,
                                instance_id=inst,
                                route_token=w.route_token,
                            )
                        ],
                    )
                    spent += time.process_time() - t0
                    generated += n
        tasks = p.claim_rewards(run, 1000)
        if tasks:
            p.record_rewards(run, [(t.sample_id, t.reward_attempt, float(rng.random() < 0.5)) for t in tasks])
        published = False
        while (got := p.consume(run, version)) is not None:
            published = True
            version = p.publish(run, version, got.consume_fence)
            steps += 1
            if store is not None:
                offload_run(engine, store, run)
                if steps % 4 == 0:
                    with psycopg.connect(to_libpq_url(url), autocommit=True) as c:
                        c.execute("VACUUM segments")
            progress(f"step {steps}: {generated} tokens generated")
            if start is None and generated >= warmup:
                start = (generated, sizes(url))
        if generated >= tokens and published and start is not None and generated > start[0]:
            break
    engine.dispose()
    assert start is not None
    return {"generated": generated, "steps": steps, "report_cpu_s": spent, "start": start}


def measure(url: str, tokens: int, warmup: int, seed: int, offload_store: str | None) -> dict[str, Any]:
    with psycopg.connect(to_libpq_url(url), autocommit=True) as c:
        c.execute("CHECKPOINT")
    got = workload(url, tokens, warmup, seed, offload_store)
    after = sizes(url)
    at, before = got.pop("start")
    n = got["generated"] - at
    per = {k: (after[k] - before[k]) / n for k in before}
    return {
        **got,
        "measured_tokens": n,
        **{f"{k}_bytes_per_token": round(v, 2) for k, v in per.items()},
        "db_mb_per_million_tokens": round(per["db"], 1),  # bytes/token x 1e6 tokens / 1e6 bytes/MB
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_500_000)
    ap.add_argument("--warmup", type=int, default=500_000, help="generated tokens before the measurement starts")
    ap.add_argument("--url", help="a server to make a scratch database on (default: a private embedded one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--offload",
        nargs="?",
        const="",
        default=None,
        help="offload finished payloads to STORE_URL (default file://tmp)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sf-storage-") as tmp:
        store = None if args.offload is None else (args.offload or Path(tmp, "store").as_uri())
        if args.url:
            from bench.server_stats import scratch_database

            with scratch_database(to_libpq_url(args.url), "sf_storage") as url:
                r = measure(url, args.tokens, args.warmup, args.seed, store)
        else:
            from bench.harness import private_postgres

            with private_postgres(Path(tmp, "pg")) as url:
                r = measure(url, args.tokens, args.warmup, args.seed, store)
    for k, v in r.items():
        print(f"{k:28s} {v}")
    print(
        f"storage bytes_per_token={r['db_bytes_per_token']} table={r['table_bytes_per_token']}"
        f" index={r['index_bytes_per_token']} wal={r['wal_bytes_per_token']}"
        f" db_mb_per_million_tokens={r['db_mb_per_million_tokens']}"
    )


if __name__ == "__main__":
    main()
