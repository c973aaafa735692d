"""staleflow_db.group_commit against a real database: items run in lock order, a refused item
refuses only itself (its writes rolled back, the others' committed), a group of one refuses as
its own transaction would, and a group with a durable item commits synchronously even when a
heartbeat in it asked for an asynchronous commit."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from staleflow_db import group_commit, queries
from staleflow_db.errors import Conflict, InvalidInput
from staleflow_db.group_commit import Item, apply_group
from tests.protocol_helpers import Driver

pytestmark = pytest.mark.db


def _lease(d: Driver, inst: int):
    return d.one("SELECT lease_expires_at FROM instances WHERE id = :i", i=inst)[0]


def test_items_run_in_lock_order_and_a_refusal_refuses_only_itself(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    live, lapsed = (d.p.register_instance(d.run, n, 0, 600) for n in ("a", "b"))
    with engine.begin() as c:
        c.execute(text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"), {"i": lapsed})
    before = {i: _lease(d, i) for i in (live, lapsed)}
    seen: list[tuple[int, int]] = []

    def heartbeat(inst: int, version: int = 0):
        def apply(conn):
            seen.append(group_commit.lease(inst))
            return d.p.heartbeat(inst, version, {}, 900, conn=conn)

        return Item(apply, group_commit.lease(inst), ephemeral=True)

    def marker(order):
        def apply(conn):
            seen.append(order)
            return conn.execute(text("SELECT 1")).scalar()

        return Item(apply, order)

    items = [
        heartbeat(lapsed),
        heartbeat(live, version=5),  # bad input: outside the run's versions
        heartbeat(live),
        marker(group_commit.instance(live)),
        marker(group_commit.run_lock(d.run)),
    ]
    outcomes = apply_group(engine, items)
    assert isinstance(outcomes[0].error, Conflict) and isinstance(outcomes[1].error, InvalidInput)
    assert [o.error for o in outcomes[2:]] == [None, None, None] and outcomes[3].value == 1
    assert _lease(d, lapsed) == before[lapsed] and _lease(d, live) > before[live]
    # run without savepoints, refused, then again with them: lock order both times
    assert seen == sorted(seen[:3]) + sorted(seen[3:]) and len(seen) > len(items)
    assert seen[0] == group_commit.run_lock(d.run)


def test_a_group_of_one_refuses_as_its_own_transaction(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    inst = d.p.register_instance(d.run, "a", 0, 600)
    calls = []

    def apply(conn):
        calls.append(1)
        d.p.heartbeat(inst, 7, {}, 900, conn=conn)

    (outcome,) = apply_group(engine, [Item(apply, group_commit.lease(inst), ephemeral=True)])
    assert isinstance(outcome.error, InvalidInput) and calls == [1]  # not run again with a savepoint


def test_a_durable_item_makes_the_group_commit_synchronous(engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    inst = d.p.register_instance(d.run, "a", 0, 600)
    settings = []

    def durable(conn):
        settings.append(conn.execute(text("SELECT current_setting('synchronous_commit')")).scalar())

    def heartbeat(conn):
        d.p.heartbeat(inst, 0, {}, 900, conn=conn)

    with engine.connect() as c:
        session = c.execute(text("SELECT current_setting('synchronous_commit')")).scalar()
        c.rollback()
        # what the group runs last when a durable item was applied beside an ephemeral one
        with c.begin():
            c.execute(text("SET LOCAL synchronous_commit = off"))
            c.execute(queries.text("group_commit_durable"))
            assert c.execute(text("SELECT current_setting('synchronous_commit')")).scalar() == session
    outcomes = apply_group(
        engine, [Item(heartbeat, group_commit.lease(inst), ephemeral=True), Item(durable, group_commit.instance(inst))]
    )
    assert [o.error for o in outcomes] == [None, None]
    assert settings == [session]  # the durable item ran first (lock order), before the heartbeat's SET LOCAL
