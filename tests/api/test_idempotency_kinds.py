"""A keyed request holds its key by one lock and lookup (staleflow_db.idempotency.once), whether
it keeps every outcome (writes) or only non-empty ones (long-polls). One key used concurrently
by one of each is refused (409), never a unique-violation 500, and only the first is applied."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from staleflow_db import idempotency
from staleflow_db.idempotency import KeyReused

WAIT_S = 60  # guards against a hang, never a timing assertion


def _once(engine, operation: str, call, store=None):
    return idempotency.once(engine, "k", operation, "", call, str, int, store=store)


def test_a_long_poll_waits_for_a_write_holding_its_key_and_is_refused(engine):
    """The write holds the key while its call runs; the long-poll started meanwhile waits on the
    key's lock (it runs nothing) until the write commits, then finds the key used: 409."""
    holding, release = threading.Event(), threading.Event()
    outcomes: dict[str, object] = {}
    polled: list[int] = []

    def write(conn):
        holding.set()  # the key is locked before the call runs
        assert release.wait(WAIT_S)
        return 1

    def poll_call(conn):
        polled.append(2)
        return 2

    def poll() -> None:
        try:
            outcomes["poll"] = _once(engine, "poll", poll_call, store=lambda out: True)
        except Exception as exc:
            outcomes["poll"] = exc

    first = threading.Thread(target=lambda: outcomes.update(write=_once(engine, "report", write)))
    first.start()
    assert holding.wait(WAIT_S)
    second = threading.Thread(target=poll)
    second.start()
    waiting = False
    for _ in range(600):  # until the poll's lookup waits on the key's advisory lock
        with engine.connect() as c:
            waiting = bool(
                c.execute(
                    text(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    )
                ).scalar()
            )
        if waiting:
            break
        time.sleep(0.05)
    assert waiting
    release.set()
    first.join(WAIT_S), second.join(WAIT_S)
    assert outcomes["write"] == (1, False)
    assert isinstance(outcomes["poll"], KeyReused), outcomes["poll"]
    assert polled == []  # refused before running anything
    with engine.connect() as c:
        assert c.execute(text("SELECT operation, response FROM idempotency")).all() == [("report#", 1)]


def test_a_key_kept_by_a_long_poll_is_refused_to_a_write(engine):
    assert _once(engine, "poll", lambda conn: 2, store=lambda out: True) == (2, False)
    with pytest.raises(KeyReused, match="already used"):
        _once(engine, "report", lambda conn: 1)
    assert _once(engine, "poll", lambda conn: 3, store=lambda out: True) == (2, True)  # replayed


def test_an_outcome_not_kept_leaves_the_key_free(engine):
    assert _once(engine, "poll", lambda conn: 0, store=lambda out: out > 0) == (0, False)
    assert _once(engine, "poll", lambda conn: 5, store=lambda out: out > 0) == (5, False)
    assert _once(engine, "poll", lambda conn: 7, store=lambda out: out > 0) == (5, True)


def test_a_serialised_outcome_replays_the_same_json_kept_as_text_or_as_a_document(engine):
    """`once_json` keeps an outcome as its JSON text; one kept as a jsonb document (by a replica
    from before) replays the same bytes."""
    from api.service import ApiProtocol
    from workers.wire.models import RouteOut

    body = b'{"results":[{"sample_id":1,"outcome":"routed","attempt":1,"v_traj":0,"buffer":0}]}'
    p = ApiProtocol(engine)
    assert p.once_json("k", "route", None, lambda conn: body, RouteOut) == (body, False)
    assert p.once_json("k", "route", None, lambda conn: b"{}", RouteOut) == (body, True)
    with engine.begin() as c:
        assert c.execute(text("SELECT jsonb_typeof(response) FROM idempotency")).scalar() == "string"
        c.execute(text("UPDATE idempotency SET response = CAST(response #>> '{}' AS jsonb)"))
        assert c.execute(text("SELECT jsonb_typeof(response) FROM idempotency")).scalar() == "object"
    assert p.once_json("k", "route", None, lambda conn: b"{}", RouteOut) == (body, True)
