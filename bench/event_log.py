"""What the event log costs per sample transition: rows, bytes on disk and WAL bytes, for the
compact log (`event_rows`, a statement's events of one kind in one row; migration 0016) and the
flat one it replaced (one row per event), side by side in one scratch database.

    python bench/event_log.py [--url URL] [--steps 40] [--batch 128] [--group 8]

Each step writes, through the real `events_insert` (compact) and the flat INSERT it replaced,
the events the protocol writes for one batch of --batch samples in groups of --group, one
statement per call as the protocol's calls do: route (sample_routed each, group_reserved per
group), report (sample_finished each), record_rewards (sample_rewarded each, group_occupied per
group), publish (one published). A step is 5 x batch transitions (routed, reported, claimed,
rewarded, trained), as bench/protocol.py counts them. Bytes are the relation's size with its
indexes and TOAST; WAL bytes are the records that touch those relations (pg_walinspect, so
other databases' traffic on a shared server is not counted). Both are exact counts, not rates.
Also printed: the wall time of the INSERTs (round trip and commit included) per transition, the
two logs' statements interleaved and each statement's median taken; it moves with the load.

The last line printed is `event_log rows_ratio=<compact/flat> bytes_ratio=<> wal_ratio=<>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import psycopg
from server_stats import scratch_database

from staleflow_db import queries
from staleflow_db.db import database_url, make_engine
from staleflow_db.protocol import Protocol
from staleflow_db.settings import to_libpq_url
from staleflow_db.types import RunConfig

# the flat log as it was before migration 0016: its table, indexes and INSERT
FLAT_DDL = """
CREATE TABLE events_flat (id bigserial PRIMARY KEY, run_id bigint NOT NULL REFERENCES runs(id),
  at timestamptz NOT NULL DEFAULT now(), kind text NOT NULL, sample_id bigint, group_id bigint,
  buffer int, instance_id bigint, data jsonb);
CREATE INDEX ix_events_flat_run ON events_flat (run_id, id);
CREATE INDEX ix_events_flat_occupied ON events_flat (run_id, group_id) WHERE kind = 'group_occupied'
"""
FLAT_INSERT = """
INSERT INTO events_flat (run_id, kind, sample_id, group_id, buffer, instance_id, data)
SELECT %(run)s, u.k, u.s, u.g, u.b, u.i, nullif((SELECT CAST(%(d)s AS jsonb)) -> (u.o::int - 1), 'null')
FROM unnest(CAST(%(k)s AS text[]), CAST(%(s)s AS bigint[]), CAST(%(g)s AS bigint[]), CAST(%(b)s AS int[]),
CAST(%(i)s AS bigint[])) WITH ORDINALITY AS u(k, s, g, b, i, o)
"""


def _event(kind: str, s=None, g=None, b=None, i=None, data=None) -> tuple:
    return kind, s, g, b, i, data


def step_statements(step: int, batch: int, group: int) -> list[list[tuple]]:
    """The events of one batch, one list per protocol call (statement)."""
    s0, groups = step * batch, [step * batch // group + j for j in range(batch // group)]
    samples = range(s0, s0 + batch)
    return [
        [_event("group_reserved", g=g, b=step, data={"version": step}) for g in groups]
        + [_event("sample_routed", s=s, i=1 + s % 64, data={"v": step}) for s in samples],
        [_event("sample_finished", s=s, i=1 + s % 64, data={"n": 32, "v": step, "generated": True}) for s in samples],
        [_event("sample_rewarded", s=s, data={"reward": 1.0}) for s in samples]
        + [_event("group_occupied", g=g, b=step, data={"version": step}) for g in groups],
        [_event("published", b=step, data={"version": step + 1})],
    ]


def _params(run: int, events: list[tuple]) -> dict:
    k, s, g, b, i, d = zip(*events)
    return {"run": run, "k": list(k), "s": list(s), "g": list(g), "b": list(b), "i": list(i), "d": json.dumps(d)}


def _relations(conn: psycopg.Connection, table: str) -> tuple[list[int], str]:
    """The relfilenodes of the table, its indexes and its TOAST (what its WAL records name)."""
    nodes = conn.execute(
        "SELECT pg_relation_filenode(c.oid) FROM pg_class c WHERE c.oid = to_regclass(%s)"
        " OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = to_regclass(%s))"
        " OR c.oid = (SELECT reltoastrelid FROM pg_class WHERE oid = to_regclass(%s))"
        " OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid ="
        "   (SELECT reltoastrelid FROM pg_class WHERE oid = to_regclass(%s)))",
        (table, table, table, table),
    ).fetchall()
    return [n for (n,) in nodes if n], table


def _one(conn: psycopg.Connection, statement: str, params: tuple = ()) -> Any:
    row = conn.execute(statement, params).fetchone()
    assert row is not None
    return row[0]


def measure(url: str, logs: dict[str, tuple[str, str]], steps: int, batch: int, group: int, run: int) -> dict:
    """Both logs' statements interleaved (flat, compact, flat ...), so the machine's load drifts
    over both alike; the time per transition is each statement's median time, summed over a step."""
    got: dict[str, dict] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        for name, (table, _) in logs.items():
            nodes, _ = _relations(conn, table)
            got[name] = {
                "table": table,
                "pattern": "|".join(f"/{n}( |,|$)" for n in nodes),
                "size0": _one(conn, "SELECT pg_total_relation_size(%s)", (table,)),
                "events": 0,
                "wal": 0,
                "times": [[] for _ in step_statements(0, batch, group)],
            }
        for step in range(steps):
            for name, (_, insert) in logs.items():
                m = got[name]
                lsn0 = _one(conn, "SELECT pg_current_wal_insert_lsn()")
                for k, statement in enumerate(step_statements(step, batch, group)):
                    params = _params(run, statement)
                    t0 = time.perf_counter()
                    conn.execute(insert, params)  # one transaction each, as a call's
                    m["times"][k].append(time.perf_counter() - t0)
                    m["events"] += len(statement)
                # each step's WAL read at once: a busy server recycles its segments quickly
                m["wal"] += int(
                    _one(
                        conn,
                        "SELECT coalesce(sum(record_length), 0) FROM pg_get_wal_records_info(%s,"
                        " pg_current_wal_flush_lsn()) WHERE block_ref ~ %s",  # flushed: past our commits
                        (lsn0, m["pattern"]),
                    )
                )
        transitions = steps * batch * 5
        out = {}
        for name, m in got.items():
            rows = _one(conn, f"SELECT count(*) FROM {m['table']}")  # our own table name
            size1 = _one(conn, "SELECT pg_total_relation_size(%s)", (m["table"],))
            out[name] = {
                "events": m["events"],
                "rows": rows,
                "rows_per_transition": rows / transitions,
                "bytes_per_transition": (size1 - m["size0"]) / transitions,
                "wal_bytes_per_transition": m["wal"] / transitions,
                "us_per_transition": sum(statistics.median(t) for t in m["times"]) * 1e6 / (batch * 5),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="any database on the server (default: STALEFLOW_DATABASE_URL, else embedded)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--group", type=int, default=8)
    args = ap.parse_args(argv)
    with scratch_database(to_libpq_url(args.url or database_url()), "sf_events") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            for statement in FLAT_DDL.split(";\n"):
                conn.execute(statement)
        engine = make_engine(url)
        config = dict(batch_size=args.batch, group_size=args.group, eta=2, max_response_tokens=64, max_prompt_tokens=64)
        run = Protocol(engine).create_run("events", RunConfig(**config))
        engine.dispose()
        compact = queries.pyformat("events_insert")
        logs = {"flat": ("events_flat", FLAT_INSERT), "compact": ("event_rows", compact)}
        got = measure(url, logs, args.steps, args.batch, args.group, run)
    print(f"{args.steps} steps of batch {args.batch} (groups of {args.group}); per sample transition:")
    print(f"{'log':>8} {'events':>8} {'rows':>7} {'rows/tr':>8} {'bytes/tr':>9} {'WAL bytes/tr':>13} {'µs/tr':>6}")
    for name, m in got.items():
        print(
            f"{name:>8} {m['events']:>8} {m['rows']:>7} {m['rows_per_transition']:>8.3f}"
            f" {m['bytes_per_transition']:>9.1f} {m['wal_bytes_per_transition']:>13.1f} {m['us_per_transition']:>6.1f}"
        )
    f, c = got["flat"], got["compact"]
    print(
        f"event_log rows_ratio={c['rows'] / f['rows']:.3f}"
        f" bytes_ratio={c['bytes_per_transition'] / f['bytes_per_transition']:.3f}"
        f" wal_ratio={c['wal_bytes_per_transition'] / f['wal_bytes_per_transition']:.3f}"
    )


if __name__ == "__main__":
    main()
