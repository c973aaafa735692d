"""bench/wal_per_call.py on a private embedded server (the WAL is the whole server's: the shared
test server's holds the other tests' writes too): each call's WAL read back by kind. A sample's
claim is a non-HOT update that inserts into exactly the indexes its new version belongs to: the
primary key, the unique (group_id, idx) index and the scoring queue's partial index, so an index
added to `samples` shows here as a cost on every state change (migration 0022 dropped one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from server_stats import scratch_database
from wal_per_call import CALLS, one_round

from staleflow_db.db import make_engine
from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig

pytestmark = pytest.mark.embedded


def test_each_call_writes_its_state_changes_and_no_more_index_entries_than_it_must(embedded_pg):
    with embedded_pg.running() as pg, scratch_database(pg.url()) as url:
        engine = make_engine(url)
        try:
            p = Protocol(engine)
            run = p.create_run("wal", RunConfig(batch_size=4, group_size=8, eta=1))
            per_call = one_round(p, run, p.register_instance(run, "i0", 0), 4, 0, url)
        finally:
            engine.dispose()
    assert list(per_call) == list(CALLS)
    for call in ("route", "report", "claim", "rewards"):
        assert per_call[call]["row updates"] >= 1.0, (call, per_call[call])  # every sample changed state
    assert per_call["report"]["row inserts"] >= 1.0, per_call["report"]  # a segment a sample
    assert per_call["claim"]["index inserts"] == pytest.approx(3.0, abs=0.05), per_call["claim"]
