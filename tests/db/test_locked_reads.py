"""Plan guards for the reads route and record_rewards send with the run lock.

`staleflow_lock_run_read` runs them with EXECUTE ... USING, planned for the actual values; a
prepared statement's first (custom) plan is the same, and EXPLAIN shows it. On a large
backlog (test_plans' database: 4 runs x 18k samples) no part of them may scan every sample or
every group: they run while every other run-locked call waits, and such scans grew with the
table (the members' joins were planned as hash joins over all samples).
"""

from __future__ import annotations

from sqlalchemy import text

from staleflow_db.protocol.base import RESERVATIONS
from staleflow_db.protocol.routing import ROUTE_READ
from staleflow_db.protocol.scoring import REWARDS_READ
from tests.db.test_plans import backlog, describe, nodes  # noqa: F401 (backlog: the fixture)

ARGS = "bigint, bigint[], bigint[], int[], float8[]"


def explain(engine, sql: str, run: int, a: list, b: list = (), c: list = (), d: list = ()) -> dict:
    def arr(xs) -> str:  # numbers only: inlined as array literals
        return "'{" + ",".join(str(x) for x in xs) + "}'"

    with engine.connect() as conn:
        conn.execute(text(f"PREPARE locked_read({ARGS}) AS {sql}"))
        try:
            args = ", ".join([str(int(run)), *(arr(x) for x in (a, b, c, d))])
            return conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) EXECUTE locked_read({args})").scalar()[0]["Plan"]
        finally:
            conn.execute(text("DEALLOCATE locked_read"))


def ids_in(engine, run: int, state: str, n: int = 64) -> list[tuple[int, int]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text(
                    "SELECT id, attempt FROM samples WHERE run_id = :r AND state = CAST(:s AS sample_state)"
                    " ORDER BY id DESC LIMIT :n"
                ),
                {"r": run, "s": state, "n": n},
            ).all()
        ]


def assert_no_full_scans(plan: dict) -> None:
    scanned = {n.get("Relation Name") for n in nodes(plan) if n["Node Type"] == "Seq Scan"}
    assert not scanned & {"samples", "prompt_groups"}, describe(plan)


def test_route_read_reaches_rows_by_index(backlog):  # noqa: F811
    engine, run, inst = backlog
    queued = [s for s, _ in ids_in(engine, run, "queued")]
    assert len(queued) == 64
    assert_no_full_scans(explain(engine, ROUTE_READ, run, [inst], queued))


def test_rewards_read_reaches_rows_by_index(backlog):  # noqa: F811
    engine, run, _ = backlog
    scoring = ids_in(engine, run, "scoring")
    assert len(scoring) == 64
    plan = explain(engine, REWARDS_READ, run, [s for s, _ in scoring], c=[a for _, a in scoring], d=[1.0] * 64)
    assert_no_full_scans(plan)


def test_reservations_read_members_by_index(backlog):  # noqa: F811
    """Every group of the backlog is reserved: still one index lookup per group."""
    engine, run, _ = backlog
    assert_no_full_scans(explain(engine, RESERVATIONS.replace(":run", "$1"), run, []))
