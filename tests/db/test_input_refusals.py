"""Small refusals and acceptances: duplicate ids in one abort batch (database and reference
model alike), and bench/protocol.py taking the SQLAlchemy-style URLs docs/settings.md documents."""

from __future__ import annotations

import psycopg
import pytest
from protocol_helpers import Driver

from staleflow_db.errors import InvalidInput
from staleflow_db.reference import ReferenceProtocol
from staleflow_db.settings import to_sqlalchemy_url
from staleflow_db.types import RunConfig


def test_abort_samples_refuses_a_sample_named_twice(engine):
    d = Driver(engine, batch_size=1, group_size=2, samples_per_group=3, eta=1)
    (g,) = d.enqueue(1)
    s = d.members(g)[0]
    before = d.rows("SELECT id, state::text FROM samples WHERE run_id = :r ORDER BY id")
    with pytest.raises(InvalidInput, match="twice"):
        d.p.abort_samples(d.run, [s, s])  # counted twice it would have doomed the group
    assert d.rows("SELECT id, state::text FROM samples WHERE run_id = :r ORDER BY id") == before
    assert d.group(g)[0] == "queued"
    assert d.p.abort_samples(d.run, [s]) == [s]  # one abort leaves N = 2 live members
    assert d.group(g)[0] == "queued"


def test_reference_model_refuses_a_sample_named_twice():
    ref = ReferenceProtocol(RunConfig(batch_size=1, group_size=2, samples_per_group=3, eta=1))
    g = ref.enqueue("k", [1, 2])
    s = ref.groups[g].sample_ids[0]
    with pytest.raises(InvalidInput, match="twice"):
        ref.abort_samples([s, s])
    assert ref.abort_samples([s]) == [s]


def test_bench_protocol_accepts_sqlalchemy_urls(db_url, monkeypatch):
    monkeypatch.syspath_prepend("bench")
    import protocol as bench_protocol

    url = to_sqlalchemy_url(db_url)
    assert url.startswith("postgresql+psycopg://")
    args = bench_protocol.parse_args(["--url", url])
    with psycopg.connect(args.url) as conn:  # what the benchmark does with it
        assert conn.execute("SELECT 1").fetchone() == (1,)
    monkeypatch.setenv("STALEFLOW_DATABASE_URL", url)
    assert bench_protocol.parse_args([]).url == db_url
