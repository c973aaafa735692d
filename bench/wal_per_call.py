"""WAL records per sample of each protocol call, by kind: what a call writes beyond its rows.

    python bench/wal_per_call.py [--url URL] [--groups 16] [--rounds 2]

One scratch database on the server (--url, else STALEFLOW_DATABASE_URL, else the embedded
default), migrated and dropped at the end. One run (groups of N=8, eta=1) and one instance; each
round enqueues --groups groups and takes their samples through route, report (finished),
claim_rewards, record_rewards, consume and publish, each call in-process through the real
protocol (`staleflow_db.protocol`) on the whole batch; all but consume (a read) are measured. Around each call the WAL is read back
with pg_walinspect (`server_stats.wal_kinds`: index inserts, row locks, updates, inserts,
commits, other), per sample of the batch. The WAL is the server's, not the database's: run it
where nothing else writes. pg_walinspect needs a superuser (the embedded default is one).

Last line: `wal_per_call route=R report=P claim=C rewards=W publish=U`, the records per sample
of each call in the last round.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from server_stats import db_work, format_kinds, scratch_database, wal_kinds

from staleflow_db.db import database_url, make_engine

CALLS = ("route", "report", "claim", "rewards", "publish")


def one_round(p, run: int, instance: int, groups: int, version: int, url: str) -> dict[str, dict[str, float]]:
    from sqlalchemy import text

    from staleflow_db.protocol import Prompt
    from staleflow_db.types import Report
    from workers.wire.enums import SegmentKind

    group_ids = p.enqueue(run, [Prompt(f"r{version}-{g}", [1, 2, 3, 4, 5, 6, 7, 8]) for g in range(groups)])
    with p.engine.connect() as c:
        samples = (
            c.execute(text("SELECT id FROM samples WHERE group_id = ANY(:g) ORDER BY id"), {"g": group_ids})
            .scalars()
            .all()
        )
    n = len(samples)
    out: dict[str, dict[str, float]] = {}

    def measured(call: str, fn, *args):
        before = db_work(url)
        got = fn(*args)
        out[call] = wal_kinds(before, db_work(url), n)
        return got

    routed = measured("route", p.route, run, [(s, instance) for s in samples])
    reports = [
        Report(
            r.sample_id,
            r.attempt,
            version,
            [7, 8],
            [-0.5, -0.5],
            SegmentKind.FINISHED,
            "stop",
            instance_id=instance,
            route_token=r.route_token,
        )
        for r in routed
    ]
    measured("report", p.report, run, reports)
    tasks = measured("claim", p.claim_rewards, run, n)
    measured("rewards", p.record_rewards, run, [(t.sample_id, t.reward_attempt, 1.0) for t in tasks])
    batch = p.consume(run, version)
    assert batch is not None, "the batch did not fill: a sample was not routed or rewarded"
    measured("publish", p.publish, run, version, batch.consume_fence)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a server to make the scratch database on (default: ours)")
    ap.add_argument("--groups", type=int, default=16, help="groups of 8 a round (the batch size)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from staleflow_db.protocol import Protocol
    from staleflow_db.types import RunConfig

    with scratch_database(args.url or database_url(), prefix="sf_wal") as url:
        engine = make_engine(url)
        p = Protocol(engine)
        config = RunConfig(batch_size=args.groups, group_size=8, eta=1, max_response_tokens=4096, max_prompt_tokens=512)
        run = p.create_run("wal-per-call", config)
        instance = p.register_instance(run, "i0", 0)
        for version in range(args.rounds):
            per_call = one_round(p, run, instance, args.groups, version, url)
            if not any(per_call.values()):
                raise SystemExit("pg_walinspect is not available on this server (it needs a superuser)")
            print(f"round {version + 1}: WAL records per sample of {args.groups * 8}")
            for call, kinds in per_call.items():
                print(f"  {call:8s} " + format_kinds(kinds))
            p.heartbeat(instance, version + 1)
        engine.dispose()
    print("wal_per_call " + " ".join(f"{c}={sum(per_call[c].values()):.2f}" for c in CALLS))


if __name__ == "__main__":
    main()
