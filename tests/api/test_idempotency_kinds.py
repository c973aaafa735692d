"""The two ways a keyed request holds its key (staleflow_db.idempotency.once): writes that always
keep their outcome claim the key's row first; long-polls, which keep only non-empty outcomes,
take an advisory lock. One key used concurrently by one of each is refused (409), never a
unique-violation 500, and only the first is applied."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text

from staleflow_db import idempotency
from staleflow_db.idempotency import KeyReused

WAIT_S = 60  # guards against a hang, never a timing assertion


def _once(engine, operation: str, call, store=None):
    return idempotency.once(engine, "k", operation, "", call, str, int, store=store)


def test_a_key_claimed_by_a_write_refuses_a_concurrent_long_poll(engine):
    """The write claims the key and holds its transaction open until the poll has looked the
    key up (nothing committed yet) and run; the poll's outcome then meets the claimed row."""
    claimed, polled = threading.Event(), threading.Event()
    outcomes: dict[str, object] = {}

    def write(conn):
        claimed.set()  # the key's row is claimed before the call runs
        assert polled.wait(WAIT_S)
        return 1

    def poll_call(conn):
        polled.set()  # its lookup found nothing: the write has not committed
        return 2

    def poll() -> None:
        try:
            outcomes["poll"] = _once(engine, "poll", poll_call, store=lambda out: True)
        except Exception as exc:
            outcomes["poll"] = exc

    first = threading.Thread(target=lambda: outcomes.update(write=_once(engine, "report", write)))
    first.start()
    assert claimed.wait(WAIT_S)
    second = threading.Thread(target=poll)
    second.start()
    first.join(WAIT_S), second.join(WAIT_S)
    assert outcomes["write"] == (1, False)
    assert isinstance(outcomes["poll"], KeyReused), outcomes["poll"]
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
