"""The sample browser's reads (`SampleReads`, samples.sql): they run on a read-only session and
give what a writable one gives, and a page is a keyset read on the samples' primary key: a page
deep in a large run visits as many samples as the first page does (no OFFSET)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import event, text

from staleflow_db import queries
from staleflow_db.db import make_engine
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.protocol.samples import SCAN, SampleFilter, SampleReads
from staleflow_db.types import RunConfig
from tests.sample_browser_helpers import browsable_run


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


def test_the_reads_run_on_a_read_only_session(engine, read_only):
    ids = browsable_run(engine)
    run, writable, ro = ids["run"], SampleReads(engine), SampleReads(read_only)
    for where in (SampleFilter(), SampleFilter(statuses=["trained"], staleness_min=1), SampleFilter(step=0)):
        assert ro.browse(run, where, None, 10) == writable.browse(run, where, None, 10)
    for k in "abcd":
        assert ro.sample(run, ids[k]) == writable.sample(run, ids[k])


def _visited(engine, run: int, before: int | None, n: int) -> int:
    """Rows the plan's scan of `samples` produced for one page (EXPLAIN ANALYZE)."""
    sql = "EXPLAIN (ANALYZE, FORMAT JSON) " + queries.sql("sample_browse")
    params = {k: None for k in queries.get("sample_browse").params} | {
        "run": run,
        "before": before,
        "n": n,
        "scan": SCAN,
    }
    with engine.connect() as c:
        c.execute(text("SET LOCAL enable_seqscan = off"))  # as on a table too large to read whole
        (plan,) = c.execute(text(sql), params).scalar_one()
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def walk(node):
        yield node
        for child in node.get("Plans", ()):
            yield from walk(child)

    scans = [p for p in walk(plan["Plan"]) if p.get("Relation Name") == "samples"]
    assert scans and all(s["Node Type"] != "Sort" for s in walk(plan["Plan"])), plan
    return sum(int(s["Actual Rows"]) * int(s.get("Actual Loops", 1)) for s in scans)


def _big_run(engine, n: int) -> tuple[int, int]:
    p = Protocol(engine)
    run = p.create_run("big", RunConfig(batch_size=1, group_size=1, eta=0))
    p.enqueue(run, [Prompt(f"k{i}", [1, 2]) for i in range(n)])
    with engine.connect() as c:
        c.execute(text("ANALYZE samples"))
        c.execute(text("ANALYZE prompt_groups"))
        c.commit()
        oldest = c.execute(text("SELECT min(id) FROM samples WHERE run_id = :r"), {"r": run}).scalar_one()
    return run, oldest


def test_a_deep_page_visits_no_more_samples_than_the_first(engine):
    run, oldest = _big_run(engine, 3000)
    first = _visited(engine, run, None, 20)
    deep = _visited(engine, run, oldest + 40, 20)
    assert first == deep == 20
    page = SampleReads(engine).browse(run, SampleFilter(), oldest + 40, 20)
    assert [r["sample_id"] for r in page.rows] == list(range(oldest + 39, oldest + 19, -1))
    assert page.next_before == oldest + 20


def test_a_rare_filter_pages_through_bounded_windows(engine):
    run, oldest = _big_run(engine, 1000)
    reads, where = SampleReads(engine), SampleFilter(statuses=["trained"])  # nothing trained
    before, requests = None, 0
    while True:
        page = reads.browse(run, where, before, 10, scan=300)
        requests += 1
        assert page.rows == []
        if page.next_before is None:
            break
        assert before is None or page.next_before == before - 300
        before = page.next_before
    assert requests == 4 and before == oldest + 100  # windows of 300, 300, 300, then the last 100
    (one,) = reads.browse(run, SampleFilter(length_max=0), oldest + 1, 10, scan=300).rows
    assert one["sample_id"] == oldest and reads.browse(run, SampleFilter(), oldest + 1, 1).next_before is None
