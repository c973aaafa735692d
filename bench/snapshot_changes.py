"""The coordinator's per-cycle read, whole snapshot against snapshot changes, by samples in flight.

    python bench/snapshot_changes.py [--sizes 1000,10000,50000] [--rounds 7] [--changed 0.02]

Per size F: a run with F samples in flight (half running on F/85 instances, the capacity
note's 85 per instance; half queued), built with the protocol. Each round is one coordinator
cycle's worth of writes (`--changed` of the in-flight samples reported through `report`, a
partial segment each, in batches of 64, and a heartbeat from a tenth of the instances), then,
side by side on one connection pool, the two reads the coordinator can make:

- full: `Protocol.snapshot` (the `snapshot` statement and the decoding to a Snapshot);
- changes: `Protocol.snapshot_changes` from the previous round's position, merged into a
  `SnapshotMirror`, and the Snapshot built from its view (what the live coordinator does).

Then, from the merged mirror, the cycle's inputs (instance snapshots and queue) both ways, in
alternating order: fresh (a `Snapshot` from the mirror's view, `instance_snapshots` of it, as
the coordinator did on 1e94cf1) and kept (`InstanceRows`, which builds again only the running
samples that changed: what the coordinator does); both must be equal. Last, `--gc-cycles` kept
cycles replay the rounds' changes, counting the cyclic GC's full collections and their longest
pause, as the process is and then frozen (`gc.freeze()`, as the coordinator after a whole read).

Reported per size: median wall ms of each read (client side: the statement, its JSON decoding
and the Snapshot built from it; `fetch`: the statement and its decoding alone), the JSON
bytes each statement returns and the sample rows in it, the server's execution time and shared
buffers of each (EXPLAIN ANALYZE, BUFFERS, once after the rounds), and the whole form's bytes
(the first read of a coordinator, and its resyncs). `STALEFLOW_DATABASE_URL` (or --url) names
the server: a scratch database is created there and dropped. The last line:

    snapshot_changes in_flight=F full_ms=A changes_ms=B full_bytes=C changes_bytes=D

for the largest size.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from server_stats import scratch_database
from sqlalchemy import text

from staleflow_db import queries
from staleflow_db.db import database_url, make_engine
from staleflow_db.protocol import Prompt, Protocol, snapshot_of
from staleflow_db.settings import to_libpq_url
from staleflow_db.types import Report, RunConfig
from workers.coordinator.instance_rows import InstanceRows, instance_snapshots
from workers.coordinator.service import QueueReader
from workers.wire.enums import SegmentKind
from workers.wire.snapshot_mirror import SnapshotMirror

PER_INSTANCE = 85
GROUP = 16


def build(p: Protocol, engine, in_flight: int) -> tuple[int, list[int], dict[int, tuple[int, int, str]]]:
    groups = in_flight // GROUP
    run = p.create_run(f"r{in_flight}", RunConfig(batch_size=groups, group_size=GROUP, eta=1))
    for k in range(0, groups, 1000):
        p.enqueue(run, [Prompt(f"k{i}", [1] * 100) for i in range(k, min(groups, k + 1000))])
    instances = [p.register_instance(run, f"i{j}", 0) for j in range(max(1, in_flight // PER_INSTANCE))]
    for i in instances:
        p.heartbeat(i, 0, heartbeat(0))
    with engine.connect() as c:
        ids = c.execute(text("SELECT id FROM samples WHERE run_id = :r ORDER BY id"), {"r": run}).scalars().all()
    pairs = [(s, instances[k % len(instances)]) for k, s in enumerate(ids[: len(ids) // 2])]
    routed: dict[int, tuple[int, int, str]] = {}
    for k in range(0, len(pairs), 2000):
        for r, (_, i) in zip(p.route(run, pairs[k : k + 2000]), pairs[k : k + 2000], strict=True):
            routed[r.sample_id] = (r.attempt, i, str(r.route_token))
    return run, instances, routed


def heartbeat(n: int) -> dict:
    return {"running": 40, "waiting": 0, "kv_used": 1000 + n, "throughput": 100.0}


def cycle_writes(p: Protocol, run: int, instances: list[int], routed: dict, rnd: int, changed: float) -> None:
    sids = sorted(routed)
    n = max(1, int(changed * 2 * len(sids)))  # `changed` of all in flight; half of them run
    picks = [sids[(rnd * 7919 + k * 104729) % len(sids)] for k in range(n)]
    picks = sorted(set(picks))
    for k in range(0, len(picks), 64):
        p.report(
            run,
            [
                Report(
                    s,
                    routed[s][0],
                    0,
                    [5],
                    [-0.1],
                    SegmentKind.PARTIAL,
                    instance_id=routed[s][1],
                    route_token=routed[s][2],
                )
                for s in picks[k : k + 64]
            ],
        )
    for i in instances[rnd % 10 :: 10]:
        p.heartbeat(i, 0, heartbeat(rnd))


def inputs(
    mirror: SnapshotMirror,
    kept: InstanceRows,
    readers: dict[str, QueueReader],
    warned: dict[str, set[int]],
    run: int,
    now: float,
    times: dict[str, list[float]] | None = None,
    first: str = "fresh",
) -> dict[str, tuple]:
    """The cycle's inputs (instance snapshots, queue) from the merged mirror, both ways, timed:
    fresh (a Snapshot from the mirror's view, `instance_snapshots` of it) and kept (`InstanceRows`:
    what the coordinator does)."""
    got: dict[str, tuple] = {}
    for way in (first, "kept" if first == "fresh" else "fresh"):
        t = time.perf_counter()
        if way == "fresh":
            snap = snapshot_of(run, mirror.view().rows())
            instances = instance_snapshots(snap, now, warned[way])
        else:
            m = mirror
            snap = snapshot_of(run, [m.run, m.buffers, [], None, m.queued_rows(), m.latest_params])
            instances = kept.snapshots(now, snap.config, warned[way])
        queue = readers[way].read(snap.queued_rows)
        if times is not None:
            times[way].append((time.perf_counter() - t) * 1000)
        got[way] = (instances, queue)
    return got


def explain(engine, name: str, params: dict) -> tuple[float, int]:
    with engine.connect() as c:
        lines = c.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + queries.text(name).text), params).scalars().all()
    ms = next(float(x.split(":")[1].split()[0]) for x in lines if x.startswith("Execution Time"))
    hits = next((int(x.split("hit=")[1].split()[0]) for x in lines if "Buffers: shared hit=" in x), 0)
    return ms, hits


def fetch(engine, name: str, params: dict) -> None:
    with engine.connect() as c:
        c.execution_options(isolation_level="AUTOCOMMIT").execute(queries.text(name), params).scalar_one()


def json_bytes(engine, name: str, params: dict) -> int:
    sql = queries.text(name).text
    with engine.connect() as c:
        return int(c.execute(text(f"SELECT octet_length(CAST(({sql}) AS text))"), params).scalar_one())


def full_collections(
    mirror: SnapshotMirror, kept: InstanceRows, reader: QueueReader, warned: set[int], run: int, docs: list, cycles: int
) -> dict[str, float]:
    """The cyclic GC's full collections over `cycles` kept cycles (the rounds' changes applied
    again in turn), as the process is, then with what it holds frozen (`gc.freeze()` after a
    collection, as the coordinator does after a whole read): count and longest, CPU ms."""
    out: dict[str, float] = {}
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.thread_time()
            else:
                pauses.append((time.thread_time() - started[0]) * 1000)

    gc.callbacks.append(on_gc)
    try:
        for way in ("unfrozen", "frozen"):
            if way == "frozen":
                gc.collect()
                gc.freeze()
            pauses.clear()
            for k in range(cycles):
                mirror.apply(docs[k % len(docs)])
                m = mirror
                snap = snapshot_of(run, [m.run, m.buffers, [], None, m.queued_rows(), m.latest_params])
                kept.snapshots(float(k), snap.config, warned)
                reader.read(snap.queued_rows)
            out[f"{way}_gcs"] = len(pauses)
            out[f"{way}_gc_max_ms"] = max(pauses, default=0.0)
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
    return out


def measure(url: str, in_flight: int, rounds: int, changed: float, gc_cycles: int = 300) -> dict:
    engine = make_engine(url)
    p = Protocol(engine)
    run, instances, routed = build(p, engine, in_flight)
    with engine.connect() as c:
        c.exec_driver_sql("ANALYZE")
    mirror = SnapshotMirror()
    mirror.apply(p.snapshot_changes(run))
    kept = InstanceRows(mirror)
    readers = {"fresh": QueueReader(), "kept": QueueReader()}
    warned: dict[str, set[int]] = {"fresh": set(), "kept": set()}  # instances reporting no capacity
    build_ms: dict[str, list[float]] = {"fresh": [], "kept": []}
    inputs(mirror, kept, readers, warned, run, 0.0)  # the first cycle of a leadership builds all
    whole_bytes = json_bytes(engine, "snapshot_changes", {"run": run, "since": None})
    docs = []  # the rounds' changes, replayed by `full_collections`
    full_ms, changes_ms, changes_bytes, changes_rows = [], [], [], []
    full_fetch, changes_fetch = [], []  # the statement and its JSON decoding alone
    for rnd in range(rounds):
        cycle_writes(p, run, instances, routed, rnd, changed)
        since = mirror.position
        changes_bytes.append(json_bytes(engine, "snapshot_changes", {"run": run, "since": since}))
        t = time.perf_counter()
        fetch(engine, "snapshot", {"run": run, "n": 20_000})
        full_fetch.append((time.perf_counter() - t) * 1000)
        t0 = time.perf_counter()
        full = p.snapshot(run)
        t1 = time.perf_counter()
        doc = p.snapshot_changes(run, since)
        docs.append(doc)
        changes_fetch.append((time.perf_counter() - t1) * 1000)
        mirror.apply(doc)
        view = mirror.view()
        merged = snapshot_of(
            run, [view.run, view.buffers, view.instances, view.running, view.queued, view.latest_params]
        )
        t2 = time.perf_counter()
        full_ms.append((t1 - t0) * 1000)
        changes_ms.append((t2 - t1) * 1000)
        changes_rows.append(len(doc[6] or ()) + len(doc[7] or ()) + len(doc[8] or ()))
        got = inputs(mirror, kept, readers, warned, run, float(rnd), build_ms, first="kept" if rnd % 2 else "fresh")
        assert got["fresh"] == got["kept"]
        assert len(merged.queued_rows) == len(full.queued_rows) and len(merged.instances) == len(full.instances)
    full_server = explain(engine, "snapshot", {"run": run, "n": 20_000})
    changes_server = explain(engine, "snapshot_changes", {"run": run, "since": mirror.position})
    pauses = full_collections(mirror, kept, readers["kept"], warned["kept"], run, docs, gc_cycles)
    out = {
        "in_flight": in_flight,
        "instances": len(instances),
        "full_ms": statistics.median(full_ms),
        "changes_ms": statistics.median(changes_ms),
        "full_fetch_ms": statistics.median(full_fetch),
        "changes_fetch_ms": statistics.median(changes_fetch),
        "full_bytes": json_bytes(engine, "snapshot", {"run": run, "n": 20_000}),
        "changes_bytes": int(statistics.median(changes_bytes)),
        "whole_bytes": whole_bytes,
        "full_rows": len(full.queued_rows) + sum(len(i.running) for i in full.instances),
        "changes_rows": int(statistics.median(changes_rows)),
        "full_server_ms": full_server[0],
        "full_hits": full_server[1],
        "changes_server_ms": changes_server[0],
        "changes_hits": changes_server[1],
        "fresh_build_ms": statistics.median(build_ms["fresh"]),
        "kept_build_ms": statistics.median(build_ms["kept"]),
        "fresh_build_max_ms": max(build_ms["fresh"]),
        "kept_build_max_ms": max(build_ms["kept"]),
        **pauses,
    }
    engine.dispose()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="any database on the server (default: STALEFLOW_DATABASE_URL, else embedded)")
    ap.add_argument("--sizes", default="1000,10000,50000")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--changed", type=float, default=0.02, help="share of the in-flight samples reported per cycle")
    ap.add_argument("--gc-cycles", type=int, default=300, help="cycles replayed to count full GC collections")
    args = ap.parse_args(argv)
    logging.getLogger("staleflow.coordinator").setLevel(logging.ERROR)  # its instances report no capacity
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        with scratch_database(to_libpq_url(args.url or database_url()), "sf_snap") as url:
            rows.append(measure(url, size, args.rounds, args.changed, args.gc_cycles))
    print(
        f"{'in_flight':>9} {'inst':>5} {'full ms':>8} {'chg ms':>7} {'fetch ms':>8} {'chg fetch':>9} {'full B':>9} {'chg B':>8} {'whole B':>9}"
        f" {'full rows':>9} {'chg rows':>8} {'full srv ms':>11} {'chg srv ms':>10} {'full hits':>9} {'chg hits':>8}"
    )
    for m in rows:
        print(
            f"{m['in_flight']:>9} {m['instances']:>5} {m['full_ms']:>8.1f} {m['changes_ms']:>7.1f}"
            f" {m['full_fetch_ms']:>8.1f} {m['changes_fetch_ms']:>9.1f} {m['full_bytes']:>9}"
            f" {m['changes_bytes']:>8} {m['whole_bytes']:>9} {m['full_rows']:>9} {m['changes_rows']:>8}"
            f" {m['full_server_ms']:>11.1f} {m['changes_server_ms']:>10.1f} {m['full_hits']:>9} {m['changes_hits']:>8}"
        )
    print("the cycle's inputs from the merged mirror (instance snapshots and queue), ms median/max:")
    for m in rows:
        print(
            f"{m['in_flight']:>9} fresh {m['fresh_build_ms']:.1f}/{m['fresh_build_max_ms']:.1f}"
            f" kept {m['kept_build_ms']:.1f}/{m['kept_build_max_ms']:.1f};"
            f" full GC collections in {args.gc_cycles} kept cycles: {m['unfrozen_gcs']:.0f}"
            f" (longest {m['unfrozen_gc_max_ms']:.1f} ms CPU), frozen {m['frozen_gcs']:.0f}"
            f" (longest {m['frozen_gc_max_ms']:.1f} ms)"
        )
    m = rows[-1]
    print(
        f"snapshot_changes in_flight={m['in_flight']} full_ms={m['full_ms']:.1f} changes_ms={m['changes_ms']:.1f}"
        f" full_bytes={m['full_bytes']} changes_bytes={m['changes_bytes']}"
    )


if __name__ == "__main__":
    main()
