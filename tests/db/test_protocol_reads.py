"""The read side never writes: every public method of `ProtocolReads` runs on sessions that
PostgreSQL keeps read-only (default_transaction_read_only), where any write would fail, and
gives what the writable session gives. The write side is another type (`Protocol`)."""

from __future__ import annotations

import inspect

import pytest
from protocol_helpers import Driver
from sqlalchemy import event, text
from sqlalchemy.exc import InternalError

from staleflow_db.db import make_engine
from staleflow_db.protocol import Protocol, ProtocolReads
from staleflow_db.protocol.reads import DASHBOARD_PANELS
from staleflow_db.types import Report
from workers.wire.enums import SegmentKind


@pytest.fixture
def read_only(db_url):
    eng = make_engine(db_url)

    @event.listens_for(eng, "connect")
    def _read_only(dbapi_conn, _record):
        dbapi_conn.execute("SET SESSION default_transaction_read_only = on")
        dbapi_conn.commit()

    try:
        yield eng
    finally:
        eng.dispose()


def _world(engine) -> tuple[Driver, int]:
    """A run one step in: an instance, a published version, a report in flight."""
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "w", 0)
    (g,) = d.enqueue(1)
    d.complete(d.members(g), inst)
    d.train(0)
    (g2,) = d.enqueue(1)
    attempts = d.routed(d.members(g2), inst)
    (s,) = attempts
    d.p.report(d.run, [Report(s, attempts[s], 1, [1], [-0.1], SegmentKind.PARTIAL, **d.route_identity(s))])
    return d, inst


def test_every_read_runs_on_a_read_only_session(engine, read_only):
    d, inst = _world(engine)
    run = d.run
    with read_only.connect() as c, pytest.raises(InternalError, match="read-only"):
        c.execute(text("UPDATE runs SET version = version"))  # the session refuses writes
    calls = {
        "list_runs": lambda r: r.list_runs(None, 10, 0),
        "get_run": lambda r: r.get_run(run),
        "run_id": lambda r: r.run_id(r.get_run(run).name),
        "param_versions": lambda r: r.param_versions(run, 10),
        "instance_owner": lambda r: r.instance_owner(inst),
        "audit": lambda r: [r.audit(v, run, 10, 0) for v in ("trained", "dropped", "violations")],
        "schema_revision": lambda r: r.schema_revision(),
        "metrics_rows": lambda r: r.metrics_rows(),
        "status": lambda r: r.status(run),
        "dashboard": lambda r: r.dashboard(run, (*DASHBOARD_PANELS, "audit")),
        "lineage": lambda r: r.lineage(run, 0),
        "export_page": lambda r: r.export_page(run, 0, 10, False),
        "export_count": lambda r: r.export_count(run, True),
    }
    public = {n for n, f in inspect.getmembers(ProtocolReads, inspect.isfunction) if not n.startswith("_")}
    public -= {"tx", "run_tx", "statement_tx", "idempotent"}  # the transaction plumbing every capability class has
    assert public == set(calls)
    writable, reads = Protocol(engine).reads, ProtocolReads(read_only)
    for name, call in calls.items():
        got, want = call(reads), call(writable)
        if name == "metrics_rows":  # lock waits are this moment's
            got, want = (got.runs, got.buffers, got.staleness), (want.runs, want.buffers, want.staleness)
        if name == "dashboard":  # the instances panel carries ages, which move between the calls
            got, want = ({k: v for k, v in x.items() if k != "instances"} for x in (got, want))
        assert got == want, name
    assert reads.status(run)["version"] == 1


def test_the_write_side_has_no_reads():
    reads = {n for n in dir(ProtocolReads) if not n.startswith("_")} - {"tx", "run_tx", "statement_tx", "idempotent"}
    reads -= {"engine", "observe_transaction"}
    assert not reads & set(dir(Protocol))
