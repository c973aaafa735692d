"""The event log's folds (migration 0016: a statement's events of one kind in one row of
`event_rows`, read back one event per row through the view `events`): the healthy run writes
folds, the view gives back every event, a fold naming a sample twice is caught by the audit, and
a fold of the wrong shape is refused by the table itself."""

from __future__ import annotations

import pytest
from audit_helpers import forge, found, healthy_run, state
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from staleflow_db.audit import violations


@pytest.fixture
def h(engine):
    run = healthy_run(engine)
    assert violations(engine, run.run) == []
    return run


def _route_fold(engine, h) -> tuple[int, list[int], list[int]]:
    """The fold that routed g1's three members to i0 (one route call)."""
    ((fid, sids, iids),) = state(
        engine,
        "SELECT id, sample_ids, instance_ids FROM event_rows WHERE run_id = :r AND kind = 'sample_routed'"
        " AND sample_ids @> CAST(:s AS bigint[])",
        r=h.run,
        s=h.members["g1"],
    )
    return fid, sids, iids


def test_the_healthy_run_folds_its_events_and_the_view_gives_each_back(engine, h):
    fid, sids, iids = _route_fold(engine, h)
    assert sorted(sids) == sorted(h.members["g1"]) and iids == [h.inst["i0"]] * 3
    assert state(engine, "SELECT sample_id, instance_id, ord FROM events WHERE id = :f ORDER BY ord", f=fid) == [
        (s, h.inst["i0"], k) for k, s in enumerate(sids, 1)
    ]
    ((rows, events),) = state(
        engine,
        "SELECT (SELECT count(*) FROM event_rows WHERE run_id = :r), (SELECT count(*) FROM events WHERE run_id = :r)",
        r=h.run,
    )
    assert rows < events
    # group_occupied is never folded: the trained-once check reads it by its partial index
    assert state(
        engine,
        "SELECT count(*) FROM event_rows WHERE run_id = :r AND kind = 'group_occupied' AND n IS NOT NULL",
        r=h.run,
    ) == [(0,)]


def test_a_fold_that_routes_one_sample_twice_and_another_never(engine, h):
    """g1 m1's place in the fold forged to name m0 again: m0 has two routes at attempt 1, m1 none."""
    fid, _, _ = _route_fold(engine, h)
    m0, m1 = h.m("g1", 0), h.m("g1", 1)
    forge(
        engine,
        "UPDATE event_rows SET sample_ids = array_replace(sample_ids, CAST(:m1 AS bigint), CAST(:m0 AS bigint))"
        " WHERE id = :f",
        f=fid,
        m0=m0,
        m1=m1,
    )
    assert found(engine, h.run) == {("segment_lineage", f"sample {m0}"), ("segment_lineage", f"sample {m1}")}
    detail = {v["subject"]: v["detail"] for v in violations(engine, h.run)}
    assert detail[f"sample {m0}"].startswith("attempt 1 after 2 routes")
    assert detail[f"sample {m1}"].startswith("attempt 1 after 0 routes")


@pytest.mark.parametrize(
    "values",
    [
        "'sample_routed', 2, ARRAY[1, 2, 3]::bigint[], NULL",  # arrays longer than the fold
        "'sample_routed', 1, ARRAY[1]::bigint[], NULL",  # a fold of one event
        "'sample_routed', 2, ARRAY[[1], [2]]::bigint[], NULL",  # two elements, but not in one dimension
        "'group_occupied', 2, NULL, ARRAY[1, 2]::bigint[]",  # Occupy must stay one row per group
    ],
)
def test_a_fold_of_the_wrong_shape_is_refused(engine, h, values):
    with pytest.raises(IntegrityError, match="ck_event_rows_fold"):
        with engine.begin() as c:
            c.execute(
                text(f"INSERT INTO event_rows (run_id, kind, n, sample_ids, group_ids) VALUES (:r, {values})"),
                {"r": h.run},
            )


def test_events_stay_append_only_through_the_view(engine, h):
    for sql in ("UPDATE events SET kind = 'x'", "DELETE FROM events", "DELETE FROM event_rows"):
        with pytest.raises(Exception, match="append-only"):
            with engine.begin() as c:
                c.execute(text(sql))
