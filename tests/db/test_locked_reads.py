"""The reads route and record_rewards send with the run lock (and record_rewards' fast path
without it): what they see, and their plans.

They are prepared statements (`staleflow_db.protocol.driver`): the first executions get a
custom plan (for the actual values), later ones the generic plan once PostgreSQL finds it no
costlier, so each guard checks both (`plan_cache_mode`). On a large
backlog (test_plans' database: 4 runs x 18k samples) no part of them may scan every sample or
every group: they run while every other run-locked call waits, and such scans grew with the
table (the members' joins were planned as hash joins over all samples).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from protocol_helpers import Driver
from sqlalchemy import text

from staleflow_db import queries
from tests.db.test_plans import backlog, describe, nodes  # noqa: F401 (backlog: the fixture)
from workers.wire.enums import GroupState

PLANS = pytest.mark.parametrize("plan_mode", ["force_custom_plan", "force_generic_plan"])


def explain(engine, name: str, run: int, plan_mode: str = "auto", **arrays: list) -> dict:
    """The plan of the named read, prepared as the driver prepares it (its parameters typed by
    the casts it has), for `run` and the `arrays`."""

    def arr(xs) -> str:  # numbers only: inlined as array literals
        return "'{" + ",".join(str(x) for x in xs) + "}'"

    sql, order = queries.positional(queries.sql(name))
    values = {"run": str(int(run))} | {k: arr(v) for k, v in arrays.items()}
    with engine.connect() as conn:
        conn.execute(text(f"SET plan_cache_mode = {plan_mode}"))
        conn.exec_driver_sql(f"PREPARE locked_read AS {sql}".replace("%", "%%"))
        try:
            args = ", ".join(values[k] for k in order)
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


@PLANS
def test_route_read_reaches_rows_by_index(backlog, plan_mode):  # noqa: F811
    engine, run, inst = backlog
    queued = [s for s, _ in ids_in(engine, run, "queued")]
    assert len(queued) == 64
    assert_no_full_scans(explain(engine, "route_read", run, plan_mode, instances=[inst], samples=queued))


@PLANS
def test_rewards_read_reaches_rows_by_index(backlog, plan_mode):  # noqa: F811
    engine, run, _ = backlog
    scoring = ids_in(engine, run, "scoring")
    assert len(scoring) == 64
    ids, attempts = [s for s, _ in scoring], [a for _, a in scoring]
    # no metrics (a text[] of NULLs): the plan does not depend on them
    metrics = ["NULL"] * 64
    plan = explain(
        engine,
        "rewards_read",
        run,
        plan_mode,
        samples=ids,
        attempts=attempts,
        rewards=[1.0] * 64,
        metrics=metrics,
        scorer=["NULL"],  # in-process: no scoring token
    )
    assert_no_full_scans(plan)


@PLANS
def test_the_fast_routes_read_reaches_rows_by_index(backlog, plan_mode):  # noqa: F811
    engine, run, inst = backlog
    queued = [s for s, _ in ids_in(engine, run, "queued")]
    for name in ("group_locks", "route_fast_read", "run_buffers"):
        assert_no_full_scans(explain(engine, name, run, plan_mode, instances=[inst], samples=queued))


@PLANS
@pytest.mark.parametrize("name", ["group_locks", "rewards_fast_check", "rewards_store"])
def test_the_rewards_fast_path_reaches_rows_by_index(backlog, plan_mode, name):  # noqa: F811
    """The group locks, the check and the store of a batch that goes without the run lock:
    they hold the groups' group locks, which other rewards of those groups wait for."""
    engine, run, _ = backlog
    scoring = ids_in(engine, run, "scoring")
    ids, attempts = [s for s, _ in scoring], [a for _, a in scoring]
    params = dict(samples=ids, attempts=attempts, rewards=[1.0] * 64, metrics=["NULL"] * 64, scorer=["NULL"])
    assert_no_full_scans(explain(engine, name, run, plan_mode, **params))


@PLANS
def test_reservations_read_members_by_index(backlog, plan_mode):  # noqa: F811
    """Every group of the backlog is reserved: still one index lookup per group."""
    engine, run, _ = backlog
    assert_no_full_scans(explain(engine, "reservations", run, plan_mode))


WAIT_S = 60  # guards against a hang, never a timing assertion


def test_a_reward_waiting_for_the_group_reward_lock_reads_what_its_holder_committed(engine):
    """Two transactions each reward half of one group. The first completes no group, so it
    goes without the run lock (another transaction takes it meanwhile) but holds the group's
    group lock; the second waits for that lock, and its check, sent after the lock, must see
    the first one's reward (one read before the lock would not): else neither places the
    group, which stays reserved for good. The second then takes the run lock and places it."""
    d = Driver(engine, batch_size=1, group_size=2, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    s1, s2 = d.members(g)
    d.finish(d.routed([s1, s2], inst))
    attempt = {t.sample_id: t.reward_attempt for t in d.p.claim_rewards(d.run, 10)}
    with engine.connect() as holder, engine.connect() as other, ThreadPoolExecutor(1) as pool:
        tx = holder.begin()
        assert d.p.record_rewards(d.run, [(s1, attempt[s1], 1.0)], conn=holder) == []
        with other.begin():  # the first reward holds no run lock
            locked = "SELECT id FROM runs WHERE id = :r FOR NO KEY UPDATE NOWAIT"
            assert other.execute(text(locked), {"r": d.run}).scalar() == d.run
        second = pool.submit(d.p.record_rewards, d.run, [(s2, attempt[s2], 0.0)])
        deadline = time.monotonic() + WAIT_S
        while not d.scalars(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
        )[0]:
            assert time.monotonic() < deadline, "the second reward never waited for the group's group lock"
            assert not second.done(), second.result()
            time.sleep(0.01)
        tx.commit()
        outcomes = second.result(timeout=WAIT_S)
    assert [(o.group_id, o.state) for o in outcomes] == [(g, GroupState.OCCUPIED)]
    assert d.group(g)[0] == "occupied"
    assert d.violations() == []
