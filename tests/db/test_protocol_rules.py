"""Placement rules of SPEC §2 that once lost or delayed work, each written from the spec as an
explicit scenario with its expected outcome, run against PostgreSQL AND the reference model.

(The model-based test compares the two implementations; a rule they share is invisible to it,
so these tests state what the spec expects instead.)
"""

from __future__ import annotations

import pytest
from protocol_helpers import Driver
from sqlalchemy import text

from staleflow_db.errors import InvalidInput
from staleflow_db.reference import ReferenceProtocol
from staleflow_db.types import Report, RunConfig
from workers.coordinator.admission import AdmissionView
from workers.coordinator.state import QueuedSample
from workers.wire.enums import GroupState, SegmentKind
from workers.wire.types import RouteOutcome

ROUTED, WINDOW_READY = RouteOutcome.ROUTED, RouteOutcome.WINDOW_READY


class DbSide(Driver):
    """The PostgreSQL implementation behind the few calls these scenarios make."""

    def register(self, version: int) -> int:
        return self.p.register_instance(self.run, "i", version)

    def interrupt_empty(self, sid: int, attempt: int, version: int) -> None:
        self.p.report(
            self.run, [Report(sid, attempt, version, [], [], SegmentKind.INTERRUPTED, **self.route_identity(sid))]
        )

    def abort_after_ready(self) -> list[int]:
        return self.p.abort_after_ready(self.run)

    def abort_group(self, gid: int) -> None:
        self.p.abort_group(self.run, gid)

    def abort_samples(self, sids) -> list[int]:
        return self.p.abort_samples(self.run, sids)

    def buffer(self, idx: int) -> tuple[int, int]:
        return self.buffers().get(idx, (0, 0))

    def events(self, kind: str):
        return self.rows(
            "SELECT group_id, buffer, data FROM events WHERE run_id = :r AND kind = :k ORDER BY id", k=kind
        )


class RefSide:
    """The reference model behind the same calls."""

    def __init__(self, **config):
        self.p = ReferenceProtocol(RunConfig(**config))
        self.keys = 0

    def register(self, version: int) -> int:
        return self.p.register_instance(version)

    def enqueue(self, n: int = 1) -> list[int]:
        self.keys += n
        return [self.p.enqueue(f"k{self.keys - n + i}", [1, 2, 3]) for i in range(n)]

    def members(self, gid: int) -> list[int]:
        return list(self.p.groups[gid].sample_ids)

    def route(self, sids, iid):
        return self.p.route([(s, iid) for s in sids])

    def routed(self, sids, iid) -> dict[int, int]:
        results = self.route(sids, iid)
        assert [r.outcome for r in results] == [ROUTED] * len(results), results
        return {r.sample_id: r.attempt for r in results}

    def finish(self, attempts: dict[int, int], version: int = 0) -> None:
        self.p.report([Report(s, a, version, [7, 8], [-0.5, -0.5], **self._ident(s)) for s, a in attempts.items()])

    def _ident(self, sid: int) -> dict:
        s = self.p.samples[sid]  # the identity the instance got with the work
        return {"instance_id": s.instance_id, "route_token": s.route_token}

    def interrupt_empty(self, sid: int, attempt: int, version: int) -> None:
        self.p.report([Report(sid, attempt, version, [], [], SegmentKind.INTERRUPTED, **self._ident(sid))])

    def reward_all(self, reward: float = 1.0):
        return self.p.record_rewards([(s, a, reward) for s, a in self.p.claim_rewards(1000)])

    def train(self, version: int) -> None:
        fence, _ = self.p.consume(version)
        assert self.p.publish(version, fence) == version + 1

    def group(self, gid: int):
        g = self.p.groups[gid]
        return g.state.value, g.reserved_buffer, g.buffer, g.group_version, g.reason

    def buffer(self, idx: int) -> tuple[int, int]:
        b = self.p.buffers.get(idx)
        return (b.occupied, b.reserved) if b else (0, 0)

    def abort_after_ready(self) -> list[int]:
        return self.p.abort_after_ready()

    def abort_group(self, gid: int) -> None:
        self.p.abort_group(gid)

    def abort_samples(self, sids) -> list[int]:
        return self.p.abort_samples(sids)

    def check(self) -> None:
        assert self.p.check_invariants() == []


@pytest.fixture(params=["postgres", "reference"])
def side(request):
    """side(**config): a fresh run on either implementation."""

    def make(**config):
        if request.param == "postgres":
            return DbSide(request.getfixturevalue("engine"), **config)
        return RefSide(**config)

    return make


def healthy(p) -> None:
    if isinstance(p, RefSide):
        p.check()
    else:
        assert p.violations() == []


def one_member(p, gid: int) -> int:
    (sid,) = p.members(gid)
    return sid


# ---- rule 1: Occupy places the releasing group before any cascade -----------------------------


def test_release_cascade_never_steals_the_finishing_groups_slot(side):
    """B=1, B'=2, η=1: G3 fills buffer 0 (ready) with G4 still reserved there. G1 finishes:
    its release frees a slot in buffer 1, which is where G1 itself must land (buffer 0 is
    ready). The cascade must not pull G4 out of the ready buffer into that slot first."""
    p = side(batch_size=1, buffer_capacity=2, group_size=1, eta=1)
    inst = p.register(0)
    g1, g2, g3, g4 = p.enqueue(4)
    att = {}
    for g in (g1, g2, g3, g4):
        att.update(p.routed(p.members(g), inst))
    assert [p.group(g)[1] for g in (g1, g2, g3, g4)] == [1, 1, 0, 0]  # Reserve: latest first
    p.finish({one_member(p, g3): att[one_member(p, g3)]})
    (o3,) = p.reward_all()
    assert (o3.state, o3.buffer) == (GroupState.OCCUPIED, 0)
    assert p.buffer(0) == (1, 1)  # ready, still holding G4's reservation
    p.finish({one_member(p, g1): att[one_member(p, g1)]})
    (o1,) = p.reward_all()
    assert (o1.state, o1.buffer, o1.reason) == (GroupState.OCCUPIED, 1, None)
    assert p.group(g4)[:2] == ("reserved", 0)  # never taken out of the ready buffer
    assert p.buffer(1) == (1, 1)
    assert sorted(p.abort_after_ready()) == sorted([g2, g4])  # now every buffer of [0, 1] is ready
    p.train(0)
    p.train(1)
    healthy(p)


def test_a_finishing_group_still_swaps_into_an_earlier_reservations_slot(side):
    """The chained cascade is kept where it lands the finishing group earlier: h1 (reserved in
    buffer 1) takes h3's slot in buffer 0 and h3 moves to buffer 1, so buffer 0 is ready now
    and h3 keeps a slot it can land in (it is not left behind in a ready buffer)."""
    p = side(batch_size=1, buffer_capacity=2, group_size=1, eta=1)
    inst = p.register(0)
    h1, h2, h3 = p.enqueue(3)
    att = {}
    for g in (h1, h2, h3):
        att.update(p.routed(p.members(g), inst))  # buffers 1, 1, 0
    p.finish({one_member(p, h1): att[one_member(p, h1)]})
    (o,) = p.reward_all()
    assert (o.state, o.buffer) == (GroupState.OCCUPIED, 0)
    assert p.group(h3)[:2] == ("reserved", 1)
    assert (p.buffer(0), p.buffer(1)) == ((1, 0), (0, 2))
    assert p.abort_after_ready() == []
    healthy(p)


# ---- rule 14: no work is routed at a version whose window is all ready ------------------------


def test_a_member_is_not_routed_at_a_version_whose_window_is_ready(side):
    """η=1, B=1, B'=2, N=1, N'=2. After step 0, G (first member at version 1) holds buffer 1,
    which becomes ready; its window [1, 2] still has room. A second member routed to an
    instance still at version 0 would make G's version 0, whose window (now just [1]) is
    ready: SPEC §2 says stop routing work at that version, so the route is refused and G lives.
    The coordinator's admission check (same rule) predicts the refusal."""
    p = side(batch_size=1, buffer_capacity=2, group_size=1, samples_per_group=2, eta=1)
    old = p.register(0)
    x, z, p1, q, g = p.enqueue(5)
    ax = p.routed(p.members(x)[:1], old)  # buffer 1
    az = p.routed(p.members(z)[:1], old)  # buffer 1 (B' = 2)
    p.finish(az)
    p.reward_all()  # z lands in buffer 0
    p.train(0)
    new = p.register(1)
    p.routed(p.members(p1)[:1], new)  # buffer 2
    p.routed(p.members(q)[:1], new)  # buffer 2: full
    first, second = p.members(g)
    p.routed([first], new)  # window [1, 2]: buffer 2 full, so buffer 1
    assert p.group(g)[:2] == ("reserved", 1)
    p.finish(ax, version=0)
    (ox,) = p.reward_all()
    assert (ox.state, ox.buffer) == (GroupState.OCCUPIED, 1)  # buffer 1 is ready now
    if isinstance(p, RefSide):
        ref = p.p
        adm = AdmissionView(
            ref.buffers, ref.version, ref.limits, {k: x.reserved_buffer for k, x in ref.reserved.items()}
        )
        queued = QueuedSample(second, g, 3)
        assert (adm.admits(queued, 0), adm.admits(queued, 1)) == (False, True)
    (r,) = p.route([second], old)
    assert r.outcome == WINDOW_READY
    assert p.abort_after_ready() == []
    assert p.group(g)[0] == "reserved"
    (r,) = p.route([second], new)  # at version 1 it may still join
    assert (r.outcome, r.v_traj) == (ROUTED, 1)
    healthy(p)


# ---- rule 15: DAPO filtering needs groups of at least two ----------------------------------


def test_dapo_filter_with_groups_of_one_is_refused(side):
    with pytest.raises(ValueError, match="dapo_filter"):
        RunConfig(batch_size=2, group_size=1, eta=1, dapo_filter=True).validate()
    with pytest.raises(InvalidInput, match="dapo_filter"):
        side(batch_size=2, group_size=1, eta=1, dapo_filter=True)
    p = side(batch_size=1, group_size=2, eta=1, dapo_filter=True)  # N >= 2 is fine
    inst = p.register(0)
    (g,) = p.enqueue(1)
    p.finish(p.routed(p.members(g), inst))
    (o,) = p.reward_all()
    assert o.state == GroupState.FILTERED


@pytest.mark.db
def test_dapo_filter_with_groups_of_one_is_a_422_over_http(db_url, engine):
    from api.auth import create_token
    from tests.api_helpers import in_process

    admin = create_token(engine, "admin")["token"]
    with in_process(db_url) as http:
        http.headers["Authorization"] = f"Bearer {admin}"
        r = http.post(
            "/v1/runs",
            json={"name": "dapo1", "config": {"batch_size": 2, "group_size": 1, "eta": 1, "dapo_filter": True}},
        )
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_input" and "dapo_filter" in r.json()["error"]["message"]
    with engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM runs")).scalar() == 0


# ---- rule 16: the group version is that of its live members ----------------------------------


def _buffer_1_ready_around(p, old):
    """Shared set-up (B=1, B'=2, η=1): buffer 0 trained, x reserved in buffer 1 (to finish
    later), z trained in step 0. Returns x's attempts."""
    x, z = p.enqueue(2)
    ax = p.routed(p.members(x)[:1], old)  # buffer 1
    az = p.routed(p.members(z)[:1], old)  # buffer 1
    return x, ax, z, az


def test_a_version_raise_raises_the_group_version(side):
    """G's only member ran at version 0 and came back with no tokens; routed again at version 1
    it takes version 1 (version raise), so G's window is [1, 2], not [0, 1]: once buffers 0 and
    1 are ready G is not aborted, and it lands in buffer 2."""
    p = side(batch_size=1, buffer_capacity=2, group_size=1, eta=1)
    old = p.register(0)
    x, ax, z, az = _buffer_1_ready_around(p, old)
    (g,) = p.enqueue(1)
    sid = one_member(p, g)
    a = p.routed([sid], old)[sid]  # window [0, 1]: buffer 1 full, so buffer 0
    assert p.group(g)[:2] == ("reserved", 0)
    p.interrupt_empty(sid, a, 0)  # back in the queue with no tokens
    p.finish(az)
    p.reward_all()  # z lands in buffer 0
    p.train(0)
    new = p.register(1)
    a = p.routed([sid], new)[sid]
    p.finish(ax)
    p.reward_all()  # x lands in buffer 1: buffers 0 and 1 are ready (0 consumed)
    assert p.abort_after_ready() == []
    p.finish({sid: a}, version=1)
    (o,) = p.reward_all()
    assert (o.state, o.buffer) == (GroupState.OCCUPIED, 2)
    assert p.group(g)[3] == 1
    healthy(p)


def test_an_aborted_member_no_longer_holds_the_group_version_down(side):
    """G's members ran at versions 0 and 1; the one at 0 is aborted. G's version is now 1: its
    window [1, 2] has room, so abort-after-ready keeps it and it lands in buffer 2."""
    p = side(batch_size=1, buffer_capacity=2, group_size=1, samples_per_group=2, eta=1)
    old = p.register(0)
    x, ax, z, az = _buffer_1_ready_around(p, old)
    (g,) = p.enqueue(1)
    m0, m1 = p.members(g)
    p.routed([m0], old)  # buffer 0
    p.finish(az)
    p.reward_all()
    p.train(0)
    new = p.register(1)
    a1 = p.routed([m1], new)[m1]
    p.finish(ax)
    p.reward_all()  # x lands in buffer 1 (ready)
    assert p.abort_samples([m0]) == [m0]
    assert p.abort_after_ready() == []
    p.finish({m1: a1}, version=1)
    (o,) = p.reward_all()
    assert (o.state, o.buffer) == (GroupState.OCCUPIED, 2)
    healthy(p)


# ---- rule 17 / 11b: reservations left in a consumed buffer ------------------------------------


def _strand_one(p):
    """B=1, B'=2, η=2: buffer 0 becomes ready while g6 is still reserved in it."""
    inst = p.register(0)
    gs = p.enqueue(6)
    att = {}
    for g in gs:
        att.update(p.routed(p.members(g), inst))
    assert [p.group(g)[1] for g in gs] == [2, 2, 1, 1, 0, 0]
    g1 = gs[0]
    p.finish({one_member(p, g1): att[one_member(p, g1)]})
    (o,) = p.reward_all()  # g1 swaps with g5: g1 in buffer 0, g5 moves to buffer 2
    assert (o.buffer, p.group(gs[4])[1]) == (0, 2)
    assert p.buffer(0) == (1, 1)
    return gs


def test_publish_moves_a_stranded_reservation_into_its_window(side):
    p = side(batch_size=1, buffer_capacity=2, group_size=1, eta=2)
    gs = _strand_one(p)
    p.abort_group(gs[1])  # frees a slot in buffer 2; the cascade moves g3 there from buffer 1
    assert (p.buffer(1), p.buffer(2)) == ((0, 1), (0, 2))
    p.train(0)
    assert p.group(gs[5])[:2] == ("reserved", 1)  # the latest buffer of [1, 2] with room
    assert p.buffer(1) == (0, 2)
    if isinstance(p, DbSide):
        assert [(g, b, d) for g, b, d in p.events("reservation_moved") if g == gs[5]] == [(gs[5], 1, {"from": 0})]
    healthy(p)


def test_publish_drops_a_stranded_reservation_whose_window_is_full(side):
    p = side(batch_size=1, buffer_capacity=2, group_size=1, eta=2)
    gs = _strand_one(p)
    p.train(0)
    assert p.group(gs[5])[0::4] == ("aborted", "window_closed")
    if isinstance(p, DbSide):
        assert (gs[5], None, {"reason": "window_closed"}) in p.events("group_aborted")
    healthy(p)


# ---- 11a: a ready buffer takes no new reservation ---------------------------------------------


def test_a_ready_buffer_with_room_admits_no_reservation(side):
    """Documented choice (docs/data-layer.md): a reservation in a ready buffer could never be
    occupied there, and the cascade never moves one out of it, so it could only be dropped."""
    p = side(batch_size=1, buffer_capacity=3, group_size=1, eta=0)
    inst = p.register(0)
    g1, g2 = p.enqueue(2)
    p.finish(p.routed(p.members(g1), inst))
    p.reward_all()
    assert p.buffer(0) == (1, 0)  # ready, two free entries
    assert [r.outcome for r in p.route(p.members(g2), inst)] == [RouteOutcome.NOT_ADMITTED]
    p.train(0)
    p.routed(p.members(g2), p.register(1))  # admitted in the next window
    healthy(p)
