"""`poll_node_idle` (a node long-poll's re-check without a transaction) against a real
database: idle only when the node poll would answer every instance empty, renew no lease,
refuse none and replay nothing; at every step it says what `poll_idle` says of each instance
with the same key, and when it says idle the node poll indeed delivers nothing and writes
nothing. A duplicate of a node poll in flight is not idle until that poll commits, and then
its key is stored."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from tests.protocol_helpers import Driver

pytestmark = pytest.mark.db

LEASE = 60.0


def _leases(d: Driver, ids: list[int]) -> list:
    rows = d.rows("SELECT id, state::text, lease_expires_at FROM instances WHERE id = ANY(:ids) ORDER BY id", ids=ids)
    return [tuple(r) for r in rows]


def _set_lease_left(d: Driver, iid: int, seconds: float) -> None:
    with d.engine.begin() as c:
        c.execute(
            text("UPDATE instances SET lease_expires_at = now() + make_interval(secs => :s) WHERE id = :i"),
            {"i": iid, "s": seconds},
        )


def test_a_node_poll_is_idle_only_when_every_instance_would_answer_empty(engine):
    d = Driver(engine, batch_size=3, group_size=1, eta=1)
    ids = [d.p.register_instance(d.run, f"i{k}", 0, lease_seconds=LEASE) for k in range(3)]
    a, b, c = ids

    def idle(key: str | None = None, which: list[int] = ids) -> bool:
        got = d.p.poll_node_idle(which, key)
        assert got == all(d.p.poll_idle(i, key) for i in which)  # each instance's own poll's conditions
        if got:  # then the node poll answers empty and changes nothing
            before = _leases(d, which)
            with engine.begin() as conn:
                out = d.p.poll_node(which, conn=conn)
            assert [(o.instance_id, o.refused, o.poll.work, o.poll.commands) for o in out] == [
                (i, None, [], []) for i in which
            ]
            assert _leases(d, which) == before
        return got

    def deliver() -> list:
        with engine.begin() as conn:
            return d.p.poll_node(ids, conn=conn)

    assert idle() and idle("never-used") and idle(which=[c, a])
    assert not idle(which=[a, 424242])  # its poll: 404
    assert not d.p.poll_node_idle([])
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    d.routed([s], c)
    assert not idle()  # work to deliver to one of them
    assert idle(which=[a, b])
    assert [len(o.poll.work) for o in deliver()] == [0, 0, 1]
    assert idle()
    assert d.p.interrupt(d.run, [s]) == 1
    assert not idle()  # a command to deliver to one of them
    assert [len(o.poll.commands) for o in deliver()] == [0, 0, 1]
    assert idle()
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO idempotency (request_id, operation, response) VALUES ('k1', 'node_poll#', '{}')")
        )
    assert idle() and not idle("k1")  # a retry replays
    _set_lease_left(d, b, 0.6 * LEASE)  # a quarter of b's lease gone: the poll renews it
    assert not idle()
    deliver()
    assert idle()
    _set_lease_left(d, a, -1.0)  # lapsed: the poll refuses it (409), every time
    assert not idle()
    assert [o.refused is not None for o in deliver()] == [True, False, False]
    assert not idle() and idle(which=[b, c])
    d.p.deregister_instance(c)  # not active
    assert not idle(which=[b, c]) and idle(which=[b])


def test_a_duplicate_of_a_node_poll_in_flight_is_not_idle(engine):
    """What a node poll delivers stays undelivered in every other snapshot until it commits,
    together with its stored outcome: a duplicate sent meanwhile runs the transaction, waits
    on the key there and replays."""
    d = Driver(engine, batch_size=2, group_size=1, eta=1)
    ids = [d.p.register_instance(d.run, f"i{k}", 0, lease_seconds=LEASE) for k in range(2)]
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    d.routed([s], ids[1])
    with engine.connect() as first:
        tx = first.begin()
        out = d.p.poll_node(ids, conn=first)
        assert [len(o.poll.work) for o in out] == [0, 1]
        first.execute(
            text("INSERT INTO idempotency (request_id, operation, response) VALUES ('k', 'node_poll#', '{}')")
        )
        assert not d.p.poll_node_idle(ids, "k") and not d.p.poll_node_idle(ids)
        tx.commit()
    assert not d.p.poll_node_idle(ids, "k") and d.p.poll_node_idle(ids)
