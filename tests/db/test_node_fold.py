"""Node sync's folded path (staleflow_db/protocol/node.py) against a real database: the same
items run through the folded statements on one run and one by one (the per-instance
operations, each under its savepoint) on an identical run, in ONE transaction (so `now()` is
the same), must give the same outcomes, or the same refusal of the whole call, and the same
rows: instances, samples, segments, events. Mixed items (reports with a snapshot, heartbeats
alone, both), a fenced instance among several, a heartbeat moving a version backwards, a
lapsed lease, bad input naming its item; and that the folded path was the one that applied.
A node's poll (`poll_node`, one statement for all its instances) delivers what `poll_work`
delivers to each, and leaves the same rows. Both lock their instances in one pass by id."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from staleflow_db.errors import Conflict, NotFound, ProtocolError
from staleflow_db.protocol import NodeHeartbeat, NodeItem
from staleflow_db.protocol.node import NodeOps
from staleflow_db.types import Report
from tests.protocol_helpers import Driver
from workers.wire.enums import SegmentKind

pytestmark = pytest.mark.db

K, M = 4, 3  # instances of the node, samples held by each
LEASE = 600.0
CAPACITY = {"max_running": 8, "kv_capacity": 4096}


@dataclass
class Node:
    """A run whose K instances each hold M routed, delivered samples."""

    d: Driver
    iids: list[int]
    works: dict[int, list]  # instance -> its delivered work

    def report(self, k: int, j: int, n: int = 10, kind=SegmentKind.PARTIAL, **kw) -> Report:
        w = self.works[self.iids[k]][j]
        fields = {"version": 0, "tokens": [k * 100 + j + t for t in range(n)], "logprobs": [-0.25] * n} | kw
        return Report(
            w.sample_id,
            fields.pop("attempt", w.attempt),
            fields.pop("version"),
            fields.pop("tokens"),
            fields.pop("logprobs"),
            kind,
            instance_id=self.iids[k],
            route_token=fields.pop("route_token", w.route_token),
            **fields,
        )


def make_node(engine, name: str, base: dt.datetime, *, version: int = 0, deliver: bool = True) -> Node:
    """`version` 1: the run trained one batch first and the instances are at version 1.
    `deliver` False: the samples are routed, not yet polled."""
    d = Driver(engine, name, batch_size=1, group_size=1, eta=K * M + 2, max_response_tokens=1000)
    if version:
        helper = d.p.register_instance(d.run, "helper", 0, LEASE)
        (gid,) = d.enqueue(1)
        d.complete(d.members(gid), helper)
        d.train(0)
    iids = [d.p.register_instance(d.run, f"i{k}", 0, LEASE, capacity=CAPACITY) for k in range(K)]
    groups = d.enqueue(K * M)
    works = {}
    for k, iid in enumerate(iids):
        d.routed([d.members(g)[0] for g in groups[k * M : (k + 1) * M]], iid)
        works[iid] = d.p.poll_work(iid).work if deliver else []
        if version:
            d.p.heartbeat(iid, version, {}, LEASE)
    with engine.begin() as c:  # the same leases and snapshot times on both runs
        c.execute(
            text("UPDATE instances SET lease_expires_at = :t, snapshot_at = :b WHERE run_id = :r"),
            {"t": base + dt.timedelta(seconds=LEASE), "b": base, "r": d.run},
        )
    return Node(d, iids, works)


def set_lease(node: Node, k: int, seconds_from_base: float, base: dt.datetime) -> None:
    with node.d.engine.begin() as c:
        c.execute(
            text("UPDATE instances SET lease_expires_at = :t WHERE id = :i"),
            {"t": base + dt.timedelta(seconds=seconds_from_base), "i": node.iids[k]},
        )


def beat(version: int = 0, capacity: dict | None = None, **snap) -> NodeHeartbeat:
    return NodeHeartbeat(version, {"running": 2, **snap, "capacity": capacity}, LEASE / 2)


# ---- the comparison ----------------------------------------------------------------------


def _ids(node: Node, conn) -> tuple[dict[int, str], dict[int, str]]:
    r = {"r": node.d.run}
    insts = conn.execute(text("SELECT id FROM instances WHERE run_id = :r ORDER BY id"), r).scalars().all()
    samples = conn.execute(text("SELECT id FROM samples WHERE run_id = :r ORDER BY id"), r).scalars().all()
    return {i: f"I{n}" for n, i in enumerate(insts)}, {s: f"S{n}" for n, s in enumerate(samples)}


def state(node: Node, conn) -> dict:
    """The run's rows with ids as ranks (the two runs' ids differ), timestamps as they compare
    to now() or as set up; events as a sorted list (the folded path writes them in one
    statement: the same events, in fewer rows)."""
    imap, smap = _ids(node, conn)
    r = {"r": node.d.run}

    def rows(sql: str) -> list:
        return [tuple(x) for x in conn.execute(text(sql), r).all()]

    instances = [
        (imap[i], *rest)
        for i, *rest in rows(
            "SELECT id, state::text, version, lease_expires_at, lease_s, snapshot, snapshot_at FROM instances"
            " WHERE run_id = :r ORDER BY id"
        )
    ]
    samples = [
        (smap[s], imap.get(i), *rest)
        for s, i, *rest in rows(
            "SELECT id, instance_id, state::text, v_traj, attempt, delivered, n_tokens, n_segments, last_version,"
            " finish_reason, updated_at = now() FROM samples WHERE run_id = :r ORDER BY id"
        )
    ]
    segments = [
        (smap[s], imap[i], *rest)
        for s, i, *rest in rows(
            "SELECT sample_id, instance_id, seq, version, attempt, token_ids, logprobs, n_tokens, finish_reason,"
            " generated, created_at = now() FROM segments WHERE run_id = :r ORDER BY sample_id, seq"
        )
    ]
    commands = [
        (kind, smap[s], imap[i], *rest)
        for kind, s, i, *rest in rows(
            "SELECT kind, sample_id, instance_id, attempt, state::text, delivered_at = now() FROM commands"
            " WHERE run_id = :r ORDER BY id"
        )
    ]
    events = sorted(
        (kind, smap.get(s), imap.get(i), repr(data))
        for kind, s, i, data in rows(
            "SELECT kind, sample_id, instance_id, data FROM events WHERE run_id = :r AND kind <> 'run_created'"
        )
    )
    return {"instances": instances, "samples": samples, "segments": segments, "commands": commands, "events": events}


def outcome(node: Node, conn, items: list[NodeItem], *, folded: bool, monkeypatch) -> object:
    """sync_node's outcomes (ids as ranks), or the refusal's type and message."""
    imap, smap = _ids(node, conn)
    imap_run = {node.d.run: "R"}
    try:
        with monkeypatch.context() as m:
            if not folded:
                m.setattr(NodeOps, "_folded", lambda self, run_id, items, conn: None)
            got = node.d.p.sync_node(node.d.run, items, conn=conn)
    except ProtocolError as e:
        return type(e).__name__, e.code, _named(str(e), imap, smap, imap_run)
    reporting = {it.instance_id for it in items if it.reports}
    out = []
    for o in got:
        keys = smap if o.instance_id in reporting else imap  # a refused report names samples, a heartbeat its instance
        refused = o.refused and [(keys[i], why) for i, why in o.refused]
        message = o.message and re.sub(r"(\d+)(?=: )", lambda m, keys=keys: keys[int(m.group(1))], o.message)
        out.append((imap[o.instance_id], o.applied, o.code, refused, message))
    return out


def _named(message: str, imap: dict[int, str], smap: dict[int, str], rmap: dict[int, str]) -> str:
    """The message with the ids of instances, samples and the run as ranks."""
    for word, ids in (("instance", imap), ("sample", smap), ("run", rmap)):
        message = re.sub(
            rf"({word} )(\d+)", lambda m, ids=ids: m.group(1) + ids.get(int(m.group(2)), m.group(2)), message
        )
    return message


Scenario = Callable[[Node, dt.datetime], list[NodeItem]]


def both(engine, monkeypatch, scenario: Scenario, *, version: int = 0, spy: list | None = None):
    """The scenario's items on two identical runs: folded on one, one by one on the other, in
    one transaction; returns (folded outcome, per-item outcome, folded state, per-item state)."""
    base = dt.datetime.now(dt.UTC).replace(microsecond=0)
    a, b = (make_node(engine, n, base, version=version) for n in ("folded", "one-by-one"))
    items_a, items_b = scenario(a, base), scenario(b, base)
    with engine.begin() as conn:
        out_a = outcome(a, conn, items_a, folded=True, monkeypatch=monkeypatch)
        out_b = outcome(b, conn, items_b, folded=False, monkeypatch=monkeypatch)
        return out_a, out_b, state(a, conn), state(b, conn)


def folded_taken(monkeypatch) -> list[str]:
    """Records which path applied: 'items' when the items ran one by one."""
    taken: list[str] = []
    original = NodeOps._sync_items

    def spy(self, run_id, items, conn):
        taken.append("items")
        return original(self, run_id, items, conn)

    monkeypatch.setattr(NodeOps, "_sync_items", spy)
    return taken


# ---- scenarios ---------------------------------------------------------------------------


def mixed(n: Node, base: dt.datetime) -> list[NodeItem]:
    """Reports with a snapshot, a heartbeat alone, reports and a heartbeat (its snapshot with no
    capacity: the report's snapshot's stays), reports alone of a lease due for renewal: every
    kind of segment, in an order that is not the instances'."""
    set_lease(n, 3, LEASE / 4, base)  # a quarter left: a report renews it
    return [
        NodeItem(
            n.iids[2], [n.report(2, 0), n.report(2, 1, 3)], {"running": 3, "capacity": {"max_running": 5}}, beat()
        ),
        NodeItem(n.iids[0], [n.report(0, j, 10) for j in range(M)], {"running": 3, "kv_used": 100}),
        NodeItem(n.iids[1], heartbeat=beat(capacity={"max_running": 6, "kv_capacity": None})),
        NodeItem(
            n.iids[3],
            [
                n.report(3, 0, 4, SegmentKind.FINISHED, finish_reason="stop"),
                n.report(3, 1, 2, SegmentKind.INTERRUPTED),
                n.report(3, 2, 3, version=None, logprobs=[], generated=False),
            ],
        ),
    ]


def lapsed_reporter(n: Node, base: dt.datetime) -> list[NodeItem]:
    set_lease(n, 1, -5, base)
    return [NodeItem(n.iids[k], [n.report(k, 0)], {"running": 1}, beat() if k == 2 else None) for k in range(K)]


def lapsed_heartbeat(n: Node, base: dt.datetime) -> list[NodeItem]:
    set_lease(n, 2, -5, base)
    return [
        NodeItem(n.iids[0], [n.report(0, 0)]),
        NodeItem(n.iids[2], heartbeat=beat()),
        NodeItem(n.iids[3], heartbeat=beat()),
    ]


def lost_route(n: Node, base: dt.datetime) -> list[NodeItem]:
    wrong = "00000000-0000-4000-8000-000000000000"
    return [
        NodeItem(n.iids[0], [n.report(0, 0), n.report(0, 1, route_token=wrong)], {"running": 9}, beat()),
        NodeItem(n.iids[1], [n.report(1, 0)], heartbeat=beat()),
        NodeItem(n.iids[3], [n.report(3, 2, attempt=n.works[n.iids[3]][2].attempt + 1)]),
    ]


def version_backwards(n: Node, base: dt.datetime) -> list[NodeItem]:
    return [
        NodeItem(n.iids[0], [n.report(0, 0, version=1)], heartbeat=beat(1)),
        NodeItem(n.iids[1], heartbeat=beat(0)),  # its instance is at version 1
        NodeItem(n.iids[2], heartbeat=beat(1)),
    ]


def beyond_the_run(n: Node, base: dt.datetime) -> list[NodeItem]:
    return [NodeItem(n.iids[1], [n.report(1, 0)], heartbeat=beat(3)), NodeItem(n.iids[0], heartbeat=beat())]


def bad_segment_version(n: Node, base: dt.datetime) -> list[NodeItem]:
    return [NodeItem(n.iids[k], [n.report(k, 0, version=5 if k == 2 else 0)]) for k in range(K)]


def unknown_sample(n: Node, base: dt.datetime) -> list[NodeItem]:
    ghost = Report(
        10**9,
        1,
        0,
        [1],
        [-0.5],
        SegmentKind.PARTIAL,
        instance_id=n.iids[1],
        route_token=n.works[n.iids[1]][0].route_token,
    )
    return [NodeItem(n.iids[0], [n.report(0, 0)]), NodeItem(n.iids[1], [ghost])]


def bad_and_fenced(n: Node, base: dt.datetime) -> list[NodeItem]:
    """A fenced item before a bad one: the bad input refuses the whole call all the same."""
    set_lease(n, 0, -5, base)
    return [NodeItem(n.iids[0], [n.report(0, 0)]), NodeItem(n.iids[1], [n.report(1, 0, tokens=[1], logprobs=[])])]


def same_sample_twice(n: Node, base: dt.datetime) -> list[NodeItem]:
    """Instance 1 reports instance 0's sample (the second item sees what the first did)."""
    stolen = n.report(0, 0, kind=SegmentKind.FINISHED)
    theirs = Report(
        stolen.sample_id,
        stolen.attempt,
        0,
        [1],
        [-0.5],
        SegmentKind.PARTIAL,
        instance_id=n.iids[1],
        route_token=stolen.route_token,
    )
    return [NodeItem(n.iids[0], [stolen]), NodeItem(n.iids[1], [theirs, n.report(1, 1)])]


def too_many_tokens(n: Node, base: dt.datetime) -> list[NodeItem]:
    return [NodeItem(n.iids[0], [n.report(0, 0, 900)]), NodeItem(n.iids[1], [n.report(1, 0, 1001)])]


# ---- tests -------------------------------------------------------------------------------


def test_mixed_items_fold_and_leave_the_rows_items_one_by_one_leave(engine, monkeypatch):
    taken = folded_taken(monkeypatch)
    out_a, out_b, state_a, state_b = both(engine, monkeypatch, mixed)
    assert taken == ["items"]  # only the run made to go one by one
    assert (
        out_a
        == out_b
        == [
            ("I2", 2, None, None, None),
            ("I0", 3, None, None, None),
            ("I1", 0, None, None, None),
            ("I3", 3, None, None, None),
        ]
    )
    assert state_a == state_b
    inst = {row[0]: row for row in state_a["instances"]}
    # the heartbeat kept the capacity its item's report snapshot carried; the lone heartbeat's own
    assert inst["I2"][5] == {"running": 2, "capacity": {"max_running": 5}} and inst["I2"][4] == LEASE / 2
    assert inst["I1"][5] == {"running": 2, "capacity": {"max_running": 6, "kv_capacity": None}}
    assert inst["I0"][5] == {"running": 3, "kv_used": 100, "capacity": CAPACITY}
    assert len(state_a["segments"]) == 8


@pytest.mark.parametrize(
    "scenario, expected",
    [
        (lapsed_reporter, [(0, 1, None), (1, 0, "conflict"), (2, 1, None), (3, 1, None)]),
        (lapsed_heartbeat, [(0, 1, None), (2, 0, "conflict"), (3, 0, None)]),
        (lost_route, [(0, 0, "conflict"), (1, 1, None), (3, 0, "conflict")]),
        (same_sample_twice, [(0, 1, None), (1, 0, "conflict")]),
    ],
)
def test_a_fenced_item_refuses_only_itself_as_one_by_one(engine, monkeypatch, scenario, expected):
    out_a, out_b, state_a, state_b = both(engine, monkeypatch, scenario)
    assert out_a == out_b
    assert [(int(i[1:]), applied, code) for i, applied, code, _, _ in out_a] == expected
    assert state_a == state_b


def test_a_refused_item_applies_nothing_of_it(engine, monkeypatch):
    out_a, _, state_a, _ = both(engine, monkeypatch, lapsed_reporter)
    assert out_a[1][3] == [("S3", "instance lease expired; register again")]
    inst = {row[0]: row for row in state_a["instances"]}
    samples = {row[0]: row for row in state_a["samples"]}
    assert inst["I1"][5] == {"capacity": CAPACITY} and inst["I1"][3] < inst["I0"][3]  # no snapshot, no renewal
    assert samples["S3"][6] == 0 and samples["S0"][6] == 10  # its tokens not applied, the others' are
    assert out_a[2][1] == 1 and inst["I2"][4] == LEASE / 2  # the heartbeat riding another item applied


def test_a_lapsed_lease_is_not_revived(engine, monkeypatch):
    out_a, out_b, state_a, state_b = both(engine, monkeypatch, lapsed_heartbeat)
    assert out_a == out_b and out_a[1][3] == [("I2", "instance lease expired; register again")]
    assert state_a == state_b
    inst = {row[0]: row for row in state_a["instances"]}
    assert inst["I2"][4] == LEASE and inst["I3"][4] == LEASE / 2


@pytest.mark.parametrize(
    "scenario, version, code, names",
    [
        (version_backwards, 1, "invalid_input", "items.1 (instance I2): instance version 0 outside 1..1"),
        (beyond_the_run, 0, "invalid_input", "items.0 (instance I1): instance version 3 outside 0..0"),
        (bad_segment_version, 0, "invalid_input", "items.2 (instance I2): sample S6: segment version 5 outside 0..0"),
        (unknown_sample, 0, "not_found", "items.1 (instance I1): sample 1000000000 in run"),
        (bad_and_fenced, 0, "invalid_input", "items.1 (instance I1): sample S3: 1 tokens but 0 log-probs"),
        (too_many_tokens, 0, "too_large", "items.1 (instance I1): sample S3: response over 1000 tokens"),
    ],
)
def test_bad_input_refuses_the_call_naming_the_item_as_one_by_one(engine, monkeypatch, scenario, version, code, names):
    out_a, out_b, state_a, state_b = both(engine, monkeypatch, scenario, version=version)
    assert out_a == out_b
    assert out_a[1] == code and names in out_a[2], out_a
    assert state_a == state_b  # nothing applied on either


def test_the_version_never_moves_backwards(engine, monkeypatch):
    out_a, _, state_a, _ = both(engine, monkeypatch, version_backwards, version=1)
    assert out_a[0] == "InvalidInput"
    assert {row[0]: row[2] for row in state_a["instances"]} == {"I0": 0, "I1": 1, "I2": 1, "I3": 1, "I4": 1}


def test_a_sync_of_heartbeats_alone_commits_asynchronously_and_one_with_reports_durably(engine):
    base = dt.datetime.now(dt.UTC)
    n = make_node(engine, "commit", base)
    with engine.connect() as conn:
        conn.execute(text("SET synchronous_commit = on"))  # the session's (the test server's default is off)
        conn.commit()
        for items, setting in (
            ([NodeItem(n.iids[0], heartbeat=beat()), NodeItem(n.iids[1], heartbeat=beat())], "off"),
            ([NodeItem(n.iids[0], [n.report(0, 0)], heartbeat=beat()), NodeItem(n.iids[1], heartbeat=beat())], "on"),
        ):
            with conn.begin():
                assert [o.refused for o in n.d.p.sync_node(n.d.run, items, conn=conn)] == [None, None]
                assert conn.execute(text("SELECT current_setting('synchronous_commit')")).scalar() == setting
        conn.execute(text("RESET synchronous_commit"))
        conn.commit()


# ---- polls -------------------------------------------------------------------------------


def poll_setup(n: Node, base: dt.datetime) -> None:
    """Instance 0: M undelivered samples (the limit takes 2); 1: lapsed; 2: a pending interrupt
    besides its samples; 3: a lease due for renewal, and one sample delivered, reported,
    interrupted and routed back to it (its poll continues after the prefix)."""
    d, (_, _, i2, i3) = n.d, n.iids
    set_lease(n, 1, -5, base)
    (w, *_) = d.p.poll_work(i3).work
    prefix = Report(
        w.sample_id,
        w.attempt,
        0,
        [9, 8, 7],
        [-0.1, -0.2, -0.3],
        SegmentKind.PARTIAL,
        instance_id=i3,
        route_token=w.route_token,
    )
    observed = Report(
        w.sample_id,
        w.attempt,
        None,
        [5, 5],
        [],
        SegmentKind.INTERRUPTED,
        generated=False,
        instance_id=i3,
        route_token=w.route_token,
    )
    d.p.report(d.run, [prefix])
    d.p.report(d.run, [observed])
    d.routed([w.sample_id], i3)
    assert d.p.interrupt(d.run, [d.scalars("SELECT id FROM samples WHERE instance_id = :i ORDER BY id", i=i2)[1]]) == 1
    set_lease(n, 3, LEASE / 4, base)


def delivered(n: Node, conn, deliveries: dict[int, object]) -> list:
    imap, smap = _ids(n, conn)
    out = []
    for iid, got in deliveries.items():
        if isinstance(got, Conflict):
            out.append((imap[iid], "Conflict", [(imap[i], why) for i, why in got.items]))
            continue
        work = [
            (
                smap[w.sample_id],
                w.attempt,
                w.v_traj,
                w.prompt_tokens,
                w.prefix_tokens,
                w.prefix_logprobs,
                w.max_new_tokens,
                w.prefix_mask,
                w.meta,
            )
            for w in got.work
        ]
        commands = [(c.kind, smap[c.sample_id], c.attempt, c.target_version) for c in got.commands]
        out.append((imap[iid], work, commands))
    return out


def test_a_node_poll_delivers_what_each_instance_s_poll_delivers(engine):
    base = dt.datetime.now(dt.UTC).replace(microsecond=0)
    a, b = (make_node(engine, name, base, deliver=False) for name in ("node", "each"))
    for n in (a, b):
        poll_setup(n, base)
    with engine.begin() as conn:
        node = {}
        for got in a.d.p.poll_node(a.iids, 2, conn=conn):
            node[got.instance_id] = got.poll if got.refused is None else Conflict(got.refused)
        each: dict[int, object] = {}
        for iid in b.iids:
            try:
                each[iid] = b.d.p.poll_work(iid, 2, conn=conn)
            except Conflict as e:
                each[iid] = e
        assert delivered(a, conn, node) == delivered(b, conn, each)
        assert state(a, conn) == state(b, conn)
        got = delivered(a, conn, node)
        leases = {row[0]: row[3] for row in state(a, conn)["instances"]}
    assert [x[1] if x[1] == "Conflict" else len(x[1]) for x in got] == [2, "Conflict", 2, 1]  # 2: the limit
    assert got[2][2] == [("interrupt", "S7", 1, None)] and got[3][2] == []
    ((_, _, _, _, prefix, _, left, mask, _),) = got[3][1]
    assert (prefix, mask, left) == ([9, 8, 7, 5, 5], [1, 1, 1, 0, 0], 995)
    assert leases["I3"] > base + dt.timedelta(seconds=LEASE / 2) and leases["I1"] < base  # renewed; not revived


def test_a_node_poll_of_an_unknown_instance_is_refused(engine):
    n = make_node(engine, "unknown", dt.datetime.now(dt.UTC), deliver=False)
    with engine.begin() as conn, pytest.raises(NotFound, match="instance 999999"):
        n.d.p.poll_node([n.iids[0], 999_999], conn=conn)


# ---- lock order --------------------------------------------------------------------------


def _locked(engine, iid: int) -> bool:
    """Whether another transaction holds a lock on the instance's row (a NOWAIT probe, undone)."""
    with engine.connect() as c:
        try:
            c.execute(text("SELECT 1 FROM instances WHERE id = :i FOR UPDATE NOWAIT"), {"i": iid})
        except OperationalError as e:
            assert isinstance(e.orig, psycopg.errors.LockNotAvailable), e
            return True
        finally:
            c.rollback()
    return False


def _waiting(engine, pids: list[int]) -> bool:
    with engine.connect() as c:
        return bool(
            c.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid = ANY(:p)"),
                {"p": pids},
            ).scalar()
        )


@pytest.mark.parametrize("call", ["sync", "poll"])
def test_instances_are_locked_in_one_pass_by_id(engine, call):
    """A, B, C by id: A and C written (a heartbeat; a lease due for a poll), B only read. With B's
    row held elsewhere, the call waits on B holding A's lock and not yet C's: each row is locked
    once, in its final mode, in id order (not the written rows first)."""
    base = dt.datetime.now(dt.UTC)
    n = make_node(engine, call, base)
    a, b, c = n.iids[:3]
    if call == "poll":
        for k in (0, 2):
            set_lease(n, k, LEASE / 4, base)
    blocker = engine.connect()
    blocker.execute(text("SELECT 1 FROM instances WHERE id = :i FOR UPDATE"), {"i": b})
    pid: list[int] = []
    done: list[object] = []

    def run() -> None:
        with engine.begin() as conn:
            pid.append(conn.execute(text("SELECT pg_backend_pid()")).scalar())
            if call == "sync":
                items = [NodeItem(a, heartbeat=beat()), NodeItem(b, [n.report(1, 0)]), NodeItem(c, heartbeat=beat())]
                done.append([o.refused for o in n.d.p.sync_node(n.d.run, items, conn=conn)])
            else:
                done.append([d.refused for d in n.d.p.poll_node([c, b, a], conn=conn)])

    t = threading.Thread(target=run)
    t.start()
    try:
        for _ in range(600):  # until the call waits on B's lock
            if pid and _waiting(engine, pid):
                break
            time.sleep(0.05)
        assert (_locked(engine, a), _locked(engine, c)) == (True, False)
    finally:
        blocker.rollback()
        blocker.close()
        t.join(60)
    assert done == [[None, None, None]]
