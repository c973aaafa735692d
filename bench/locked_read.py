"""The run lock with its locked read, two ways side by side on the same rows and connection.

    python bench/locked_read.py [--url URL] [--blocks 10] [--calls 40]

`function`: migration 0005's `staleflow_lock_run_read`, which runs the read with EXECUTE and
so plans it on every call (installed, unused); `pipeline`: what route and record_rewards send (`staleflow_db/protocol/driver.py`): the lock function,
then the read as a prepared statement, in one round trip. Each timed call is one transaction
(BEGIN, lock + read, ROLLBACK) on a run with 4,000 queued groups; blocks alternate which way
goes first, the first two blocks are warm-up. Route's read (instances, samples, groups,
members) and record_rewards' read (samples, groups, members, reservations) at 16 and 128
samples. The last line is

    locked_read function_ms=<a> pipeline_ms=<b> ratio=<a/b>

for route's read at 16 samples (medians of the blocks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from server_stats import scratch_database
from sqlalchemy import text

from staleflow_db import queries
from staleflow_db.db import database_url, make_engine
from staleflow_db.protocol import Prompt, Protocol, driver
from staleflow_db.protocol.core import LockedRead
from staleflow_db.settings import to_libpq_url
from staleflow_db.types import RunConfig

FUNCTION = (
    "SELECT staleflow_lock_run_read(:run, :q, CAST(:a AS bigint[]), CAST(:b AS bigint[]),"
    " CAST(:c AS int[]), CAST(:d AS float8[]))"
)
# which of the function's arguments ($1 the run, $2..$5 a, b, c, d) each read's parameter is
SLOTS = {
    "route_read": {"run": 1, "instances": 2, "samples": 3},
    "rewards_read": {"run": 1, "samples": 2, "attempts": 4, "rewards": 5},
}


def function_params(run: int, read: LockedRead) -> dict:
    """The read as the function's query ($1..$5) and its arrays."""
    slots = SLOTS[read.name]
    sql = queries.BIND.sub(lambda m: f"${slots[m.group(1)]}", queries.sql(read.name))
    params = {"run": run, "q": sql, "a": [], "b": [], "c": [], "d": []}
    for name, slot in slots.items():
        if slot > 1:
            params["abcd"[slot - 2]] = list(read.params[name])
    return params


def timed(conn, run: int, read: LockedRead, way: str, calls: int) -> float:
    """Milliseconds per transaction (lock + read, then rollback)."""
    params = function_params(run, read)
    t = time.perf_counter()
    for _ in range(calls):
        if way == "function":
            conn.execute(text(FUNCTION), params).scalar()
        else:
            driver.scalars(conn, [(queries.pyformat("lock_run"), {"run": run}), read.statement(run)])
        conn.rollback()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--url", default=None, help="any database on the server (default: STALEFLOW_DATABASE_URL, else embedded)"
    )
    ap.add_argument("--blocks", type=int, default=10, help="timed blocks per way (after 2 of warm-up)")
    ap.add_argument("--calls", type=int, default=40, help="transactions per block")
    args = ap.parse_args()
    server = to_libpq_url(args.url or database_url())
    figures: dict[tuple[str, int], tuple[float, float]] = {}
    with scratch_database(server) as url:
        engine = make_engine(url, pool_pre_ping=False)
        p = Protocol(engine)
        config = RunConfig(batch_size=128, group_size=8, eta=2, max_response_tokens=4096, max_prompt_tokens=512)
        run = p.create_run("locked-read", config)
        print("enqueueing 4,000 groups x 8 ...", file=sys.stderr, flush=True)
        p.enqueue(run, [Prompt(f"p{i}", [1, 2, 3]) for i in range(4000)])
        inst = p.register_instance(run, "bench", 0)
        with engine.connect() as conn:
            ids = conn.execute(
                text("SELECT id FROM samples WHERE run_id = :r ORDER BY id LIMIT 128"), {"r": run}
            ).scalars()
            ids = list(ids)
            conn.execute(text("ANALYZE"))
            conn.commit()
            for n in (16, 128):
                reads = {
                    "route": LockedRead("route_read", {"instances": [inst], "samples": ids[:n]}),
                    "record_rewards": LockedRead(
                        "rewards_read", {"samples": ids[:n], "attempts": [1] * n, "rewards": [0.5] * n}
                    ),
                }
                for name, read in reads.items():
                    got: dict[str, list[float]] = {"function": [], "pipeline": []}
                    for block in range(args.blocks + 2):
                        for way in ("function", "pipeline") if block % 2 else ("pipeline", "function"):
                            ms = timed(conn, run, read, way, args.calls)
                            if block >= 2:
                                got[way].append(ms)
                    f, pl = statistics.median(got["function"]), statistics.median(got["pipeline"])
                    figures[(name, n)] = (f, pl)
                    print(f"{name:>15} n={n:<4} function {f:6.3f} ms   pipeline {pl:6.3f} ms   ratio {f / pl:5.2f}")
        engine.dispose()
    f, pl = figures[("route", 16)]
    print(f"locked_read function_ms={f:.3f} pipeline_ms={pl:.3f} ratio={f / pl:.2f}")


if __name__ == "__main__":
    main()
