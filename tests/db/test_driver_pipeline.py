"""The run lock and the locked read go to psycopg in one pipeline (`staleflow_db.protocol.driver`),
outside SQLAlchemy's execute: their errors must still arrive as SQLAlchemy's (the deadlock retry
and the outage handling look for those), a connection that broke must leave the pool, and the
read is prepared once per connection."""

from __future__ import annotations

import logging
import re
import threading

import pytest
from protocol_helpers import Driver
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from staleflow_db import queries
from staleflow_db.protocol import driver
from staleflow_db.retry import is_db_unavailable


def one_queued(engine) -> tuple[Driver, int, int]:
    """A run with one queued sample and one instance to route it to."""
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    return d, s, d.p.register_instance(d.run, "i", 0)


def test_a_named_query_in_psycopgs_form_keeps_casts_and_escapes_percent_signs():
    got = queries.to_pyformat("SELECT CAST(:run AS bigint), x::int, '10%' LIKE 'x%', :run")
    assert got == "SELECT CAST(%(run)s AS bigint), x::int, '10%%' LIKE 'x%%', %(run)s"


def test_a_lock_timeout_under_the_pipeline_is_sqlalchemys_error_and_changes_nothing(engine):
    d, s, inst = one_queued(engine)
    with engine.connect() as holder, engine.connect() as waiter:
        holder.begin()
        holder.execute(text("SELECT 1 FROM runs WHERE id = :r FOR NO KEY UPDATE"), {"r": d.run})
        waiter.begin()
        waiter.execute(text("SET LOCAL lock_timeout = '100ms'"))
        with pytest.raises(sa_exc.OperationalError) as refused:
            d.p.route(d.run, [(s, inst)], conn=waiter)
        assert refused.value.orig.sqlstate == "55P03"  # lock_not_available, with `orig` as always
        assert is_db_unavailable(refused.value)
        waiter.rollback()
        holder.rollback()
    assert d.sample(s)[0] == "queued"
    assert [r.outcome for r in d.route([s], inst)] == ["routed"]


def test_a_backend_killed_under_the_pipeline_invalidates_its_connection(engine):
    """The route's backend is terminated while it waits for the run lock: the caller gets
    SQLAlchemy's error marked as a lost connection, the pool drops that connection, and the
    next route works on a new one."""
    d, s, inst = one_queued(engine)
    errors: list[BaseException] = []
    invalidated: list[bool] = []
    pids: list[int] = []
    with engine.connect() as holder, engine.connect() as watch:
        holder.begin()
        holder.execute(text("SELECT 1 FROM runs WHERE id = :r FOR NO KEY UPDATE"), {"r": d.run})

        def route() -> None:
            with engine.connect() as conn:
                pids.append(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
                conn.commit()
                try:
                    d.p.route(d.run, [(s, inst)], conn=conn)
                except BaseException as e:  # the error is the result
                    errors.append(e)
                    invalidated.append(conn.invalidated)

        t = threading.Thread(target=route)
        t.start()
        for _ in range(2000):
            waiting = watch.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(:p) AND wait_event_type = 'Lock'"),
                {"p": pids},
            ).scalar_one()
            watch.rollback()  # the statistics views are read once per transaction
            if waiting:
                break
            t.join(0.01)
        assert waiting, "the route never waited for the run lock"
        holder.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pids[0]})
        t.join(60)
        holder.rollback()
    (err,) = errors
    assert isinstance(err, sa_exc.DBAPIError) and err.connection_invalidated, repr(err)
    assert invalidated == [True]  # so it is discarded, not handed back to the pool
    assert is_db_unavailable(err)
    assert d.sample(s)[0] == "queued"
    assert [r.outcome for r in d.route([s], inst)] == ["routed"]


def test_a_connection_killed_while_idle_is_invalidated_and_reported_once(engine, caplog):
    """A pooled connection whose backend died while idle (a server restart; the service's pool
    does not ping): the route's first send fails inside the pipeline. The caller gets
    SQLAlchemy's error, the connection leaves the pool, and nothing else is logged for it
    (psycopg would add a warning that the pipeline, too, could not close)."""
    d, s, inst = one_queued(engine)
    with engine.connect() as conn, engine.connect() as killer:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.commit()
        assert killer.execute(text("SELECT pg_terminate_backend(:p, 10000)"), {"p": pid}).scalar_one()
        killer.commit()
        with pytest.raises(sa_exc.DBAPIError) as lost:
            d.p.route(d.run, [(s, inst)], conn=conn)
        assert lost.value.connection_invalidated and conn.invalidated, repr(lost.value)
    assert is_db_unavailable(lost.value)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []
    assert [r.outcome for r in d.route([s], inst)] == ["routed"]


def test_the_locked_read_is_prepared_once_per_connection(engine):
    d = Driver(engine, batch_size=4, group_size=1, eta=0)
    groups = d.enqueue(4)
    inst = d.p.register_instance(d.run, "i", 0)
    with engine.connect() as conn:
        for g in groups:
            (s,) = d.members(g)
            d.p.route(d.run, [(s, inst)], conn=conn)
            conn.commit()
        prepared = conn.execute(
            text("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE :q"),
            # long enough to tell it from route_fast_read, which starts alike
            {"q": "%" + queries.sql("route_read")[:100].replace("%", r"\%") + "%"},
        ).scalar_one()
    assert prepared == 1


def test_a_backend_killed_mid_transaction_logs_one_line_when_its_connection_returns(engine, caplog):
    """A pooled connection's backend is terminated while its transaction (begun by a pipeline,
    which SQLAlchemy's own rollback does not see) is open: returning the connection, the pool's
    rollback fails and it drops the connection. That is one warning, not SQLAlchemy's
    "Exception during reset" traceback, and the pool goes on with a new connection."""
    with engine.connect() as killer:
        with engine.connect() as conn:
            pid = conn.connection.driver_connection.info.backend_pid
            assert driver.scalars(conn, [("SELECT 1", {})]) == [1]
            assert killer.execute(text("SELECT pg_terminate_backend(:p, 10000)"), {"p": pid}).scalar_one()
            killer.commit()
        with engine.connect() as conn:
            assert conn.connection.driver_connection.info.backend_pid != pid
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.name, r.levelname) for r in logged] == [("sqlalchemy.pool.impl.QueuePool", "WARNING")], caplog.text
    assert re.fullmatch(r"pooled connection lost \(.+\); dropped from the pool", logged[0].getMessage())
    assert logged[0].exc_info is None and "Traceback" not in caplog.text and "\n" not in logged[0].getMessage()
