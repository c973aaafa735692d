"""Database round trips per rollout call, counted from libpq's trace of the one pooled
connection (a message from the client after one from the server starts a round trip; the
pool's pre-ping on checkout is one). A scratch database on the server of
STALEFLOW_DATABASE_URL (else the embedded default).

    python bench/round_trips.py [--rounds 6]

Each round routes 4 samples to one instance, then counts: a poll that delivers them, a poll
that delivers one command, an empty poll, a report finishing them, and node polls of that
instance and a second one (node sync's `poll`, `poll_node`): one that delivers a command to
the second, an empty one. The odd rounds call the data layer alone (`poll_work`, `report`,
`poll_node` in a transaction); the even ones run them as the API does, under an
Idempotency-Key (`idempotency.once`; a poll and a node poll with the idle check first where the
code has one, as api/routers/rollout.py's and node.py's). Counts are taken after every
statement was prepared (psycopg prepares on a statement's 5th execution, one extra round trip
once), so they are those of the steady state; the last round of each kind is printed.

Last line: ``round_trips poll=P poll_empty=E report=R keyed_poll=KP keyed_poll_empty=KE
keyed_report=KR node_poll_empty=NE keyed_node_poll=KN keyed_node_poll_empty=KNE``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.server_stats import scratch_database
from staleflow_db import idempotency
from staleflow_db.db import database_url, make_engine
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.protocol.core import CommandTarget, dumps, send_commands
from staleflow_db.protocol.rollout import Poll
from staleflow_db.types import Report, RunConfig
from workers.wire.enums import SegmentKind


class Tracer:
    """Round trips of the pooled connection while a call runs, from its libpq trace."""

    def __init__(self, raw: psycopg.Connection):
        self.path = tempfile.NamedTemporaryFile(prefix="staleflow-rt-", delete=False).name
        self.file = open(self.path, "w")  # open for the whole run
        raw.pgconn.trace(self.file.fileno())
        raw.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)

    def count(self, call: Callable[[], Any]) -> tuple[Any, int]:
        self.file.flush()
        start = os.path.getsize(self.path)
        out = call()
        self.file.flush()
        with open(self.path) as t:
            t.seek(start)
            directions = [line.split("\t", 1)[0] for line in t.read().splitlines() if line.strip()]
        trips, previous = 0, "B"
        for d in directions:
            trips += d == "F" and previous == "B"
            previous = d
        return out, trips


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each kind (plain, keyed)")
    args = ap.parse_args()
    config = RunConfig(batch_size=128, group_size=8, eta=2, max_response_tokens=4096, max_prompt_tokens=512)
    with scratch_database(database_url(), "sf_round_trips") as db:
        engine = make_engine(db, pool_size=1, max_overflow=0)
        p = Protocol(engine)
        run = p.create_run("round-trips", config)
        p.enqueue(run, [Prompt(f"p{i}", [1, 2, 3]) for i in range(8 * args.rounds)])
        with engine.connect() as c:
            todo: list[int] = list(
                c.execute(text("SELECT id FROM samples WHERE run_id = :r ORDER BY group_id, idx"), {"r": run}).scalars()
            )
            raw = c.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
        inst = p.register_instance(run, "i", 0, lease_seconds=60)
        node = [inst, p.register_instance(run, "j", 0, lease_seconds=60)]
        idle_check = "idle" in inspect.signature(idempotency.once).parameters
        node_idle_check = hasattr(p, "poll_node_idle")

        def keyed_poll() -> Poll:
            key = uuid.uuid4().hex
            kw: dict[str, Any] = {}
            if idle_check:
                kw["idle"] = lambda c: Poll() if p.poll_idle(inst, key, conn=c) else None
            out: Poll = idempotency.once(
                engine,
                key,
                "poll",
                "d",
                lambda c: p.poll_work(inst, 8, conn=c),
                dumps,
                lambda r: r,
                lambda o: bool(o.work or o.commands),
                **kw,
            )[0]
            return out

        def node_poll() -> list[Any]:
            with engine.begin() as c:
                return p.poll_node(node, 8, conn=c)

        def keyed_node_poll() -> list[Any]:
            key = uuid.uuid4().hex
            kw: dict[str, Any] = {}
            if node_idle_check:
                kw["idle"] = lambda c: [] if p.poll_node_idle(node, key, conn=c) else None
            out: list[Any] = idempotency.once(
                engine,
                key,
                "node_poll",
                "d",
                lambda c: p.poll_node(node, 8, conn=c),
                dumps,
                lambda r: r,
                lambda o: any(d.poll.work or d.poll.commands for d in o),
                **kw,
            )[0]
            return out

        def keyed_report(reports: list[Report]) -> int:
            return int(
                idempotency.once(
                    engine, uuid.uuid4().hex, "report", "d", lambda c: p.report(run, reports, conn=c), str, int
                )[0]
            )

        for _ in range(6):  # every statement prepared before counting
            p.poll_work(inst, 8)
            keyed_poll()
            node_poll()
            keyed_node_poll()
        tracer = Tracer(raw)
        last: dict[str, dict[str, int]] = {}
        for rnd in range(2 * args.rounds):
            keyed = rnd % 2 == 1
            poll = keyed_poll if keyed else lambda: p.poll_work(inst, 8)
            picked, todo = todo[:4], todo[4:]
            p.route(run, [(s, inst) for s in picked])
            got, work_trips = tracer.count(poll)
            with engine.begin() as c:
                w = got.work[0]
                send_commands(c, run, "interrupt", [CommandTarget(w.sample_id, inst, w.attempt)])
            got_command, command_trips = tracer.count(poll)
            assert len(got_command.commands) == 1 and not got_command.work
            empty, empty_trips = tracer.count(poll)
            assert not empty.work and not empty.commands
            reports = [
                Report(
                    x.sample_id,
                    x.attempt,
                    x.v_traj,
                    [1, 2],
                    [-0.5, -0.5],
                    SegmentKind.FINISHED,
                    "stop",
                    instance_id=inst,
                    route_token=x.route_token,
                )
                for x in got.work
            ]
            report = (lambda: keyed_report(reports)) if keyed else (lambda: p.report(run, reports))
            _, report_trips = tracer.count(report)
            with engine.begin() as c:
                send_commands(c, run, "interrupt", [CommandTarget(w.sample_id, node[1], w.attempt)])
            node_got, node_command_trips = tracer.count(keyed_node_poll if keyed else node_poll)
            assert [len(d.poll.commands) for d in node_got] == [0, 1]
            node_empty, node_trips = tracer.count(keyed_node_poll if keyed else node_poll)
            assert all(d.refused is None and not d.poll.work and not d.poll.commands for d in node_empty)
            kind = "keyed" if keyed else "plain"
            last[kind] = {"poll": work_trips, "poll_command": command_trips, "poll_empty": empty_trips}
            last[kind] |= {"report": report_trips, "node_poll": node_command_trips, "node_poll_empty": node_trips}
            print(
                f"{kind} (round {rnd // 2}): poll with work {work_trips}, with a command {command_trips},"
                f" empty {empty_trips}; report {report_trips}; node poll of 2 with a command"
                f" {node_command_trips}, empty {node_trips}"
            )
        engine.dispose()
    a, k = last["plain"], last["keyed"]
    print(
        f"round_trips poll={a['poll']} poll_empty={a['poll_empty']} report={a['report']}"
        f" keyed_poll={k['poll']} keyed_poll_empty={k['poll_empty']} keyed_report={k['report']}"
        f" node_poll_empty={a['node_poll_empty']} keyed_node_poll={k['node_poll']}"
        f" keyed_node_poll_empty={k['node_poll_empty']}"
    )


if __name__ == "__main__":
    main()
