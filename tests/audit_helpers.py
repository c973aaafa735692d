"""A healthy run driven through the real protocol, and tools to break it behind the protocol's
back, for the audit tests.

`healthy_run` leaves (B=1, B'=2, N=2, N'=3, eta=1, DAPO filter on):

    buffer 0  consumed: g1 (V 0), members m0 m1 trained, m2 aborted (surplus)
    buffer 1  consumed: g2 (V 0, staleness 1), m0 has segments at versions 0 then 1 (interrupted)
    buffer 2  ready:    g4 occupied (V 2, m0 in two segments); g3 still reserved here
                        (m0 queued with tokens, m1 running on i1, m2 queued fresh)
    buffer 3  empty (g4 reserved it before occupying buffer 2)
    g5 filtered (all rewards equal) -> g5r queued replacement; g6 queued
    run version 2; instances i0 (v0), i1 (v1), i2 (v2), all active
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol_helpers import Driver
from sqlalchemy import text

from staleflow_db.audit import violations
from staleflow_db.types import Report
from workers.wire.enums import SegmentKind


@dataclass
class Healthy:
    d: Driver
    inst: dict[str, int] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)

    @property
    def run(self) -> int:
        return self.d.run

    def m(self, group: str, idx: int) -> int:
        return self.members[group][idx]


def found(engine, run_id: int) -> set[tuple[str, str]]:
    """(invariant, subject) of every violation of the run."""
    return {(v["invariant"], v["subject"]) for v in violations(engine, run_id)}


def forge(engine, *statements: str, drop_checks: tuple[tuple[str, str], ...] = (), **params) -> None:
    """Run SQL with triggers and foreign-key checks off (session_replication_role = replica)
    after dropping the named (table, CHECK constraint) pairs, in one transaction."""
    with engine.begin() as c:
        c.execute(text("SET LOCAL session_replication_role = replica"))
        for table, check in drop_checks:
            c.execute(text(f"ALTER TABLE {table} DROP CONSTRAINT {check}"))
        for sql in statements:
            c.execute(text(sql), params)


def _report(d: Driver, sid: int, attempt: int, version: int, tokens, kind: SegmentKind) -> None:
    d.p.report(
        d.run, [Report(sid, attempt, version, list(tokens), [-0.5] * len(tokens), kind, **d.route_identity(sid))]
    )


def healthy_run(engine, name: str = "healthy", check=None) -> Healthy:
    """Drive the run above through the protocol; `check()` (if given) runs after each step."""
    check = check or (lambda: None)
    d = Driver(
        engine, name=name, batch_size=1, buffer_capacity=2, group_size=2, samples_per_group=3, eta=1, dapo_filter=True
    )
    h = Healthy(d)
    p = d.p
    h.inst["i0"] = p.register_instance(d.run, "i0", 0)
    for key, gid in zip(("g1", "g2", "g3", "g4", "g5", "g6"), d.enqueue(6)):
        h.groups[key] = gid
        h.members[key] = d.members(gid)
    check()
    i0 = h.inst["i0"]
    a1 = d.routed(h.members["g1"], i0)  # g1 reserves buffer 1 (latest of [0, 1])
    a2 = d.routed(h.members["g2"], i0)  # g2 too (B' = 2)
    check()
    g1m, g2m = h.members["g1"], h.members["g2"]
    d.finish({g1m[0]: a1[g1m[0]], g1m[1]: a1[g1m[1]]}, version=0)
    check()
    d.reward_all(rewards={g1m[0]: 0.0, g1m[1]: 1.0})  # occupies buffer 0; g1 m2 aborted (surplus)
    check()
    d.train(0)
    check()
    # g2 m0: a partial segment at version 0, interrupted, resumed, finished at version 1
    _report(d, g2m[0], a2[g2m[0]], 0, [4, 5], SegmentKind.PARTIAL)
    _report(d, g2m[0], a2[g2m[0]], 0, [6], SegmentKind.INTERRUPTED)
    check()
    h.inst["i1"] = p.register_instance(d.run, "i1", 1)
    resumed = d.routed([g2m[0]], h.inst["i1"])
    _report(d, g2m[0], resumed[g2m[0]], 1, [7], SegmentKind.FINISHED)
    d.finish({g2m[1]: a2[g2m[1]]}, version=0)
    check()
    d.reward_all(rewards={g2m[0]: 0.5, g2m[1]: 1.0})  # occupies buffer 1 at staleness 1
    check()
    d.train(1)
    check()
    g3m = h.members["g3"]
    a3 = d.routed(g3m[:2], h.inst["i1"])  # V 1 at run version 2: reserves buffer 2
    _report(d, g3m[0], a3[g3m[0]], 1, [1, 2], SegmentKind.INTERRUPTED)
    _report(d, g3m[1], a3[g3m[1]], 1, [3], SegmentKind.PARTIAL)
    check()
    h.inst["i2"] = p.register_instance(d.run, "i2", 2)
    g4m = h.members["g4"]
    a4 = d.routed(g4m, h.inst["i2"])  # V 2: reserves buffer 3
    _report(d, g4m[0], a4[g4m[0]], 2, [1], SegmentKind.PARTIAL)
    d.finish({g4m[0]: a4[g4m[0]], g4m[1]: a4[g4m[1]]}, version=2)
    check()
    d.reward_all(rewards={g4m[0]: 0.0, g4m[1]: 1.0})  # occupies buffer 2 (earliest of [2, 3])
    check()
    g5m = h.members["g5"]
    a5 = d.routed(g5m, h.inst["i2"])
    d.finish({g5m[0]: a5[g5m[0]], g5m[1]: a5[g5m[1]]}, version=2)
    (outcome,) = d.reward_all(reward=1.0)  # all equal: filtered, replacement enqueued
    h.groups["g5r"] = outcome.replacement
    h.members["g5r"] = d.members(outcome.replacement)
    check()
    return h


def state(engine, sql: str, **params):
    with engine.connect() as c:
        return c.execute(text(sql), params).all()


@dataclass
class TrainedAndReady:
    """`trained_and_ready`: group `a` trained at step 0, group `c` ready in buffer 1."""

    d: Driver
    a: int
    c: int

    @property
    def run(self) -> int:
        return self.d.run


def trained_and_ready(engine, name: str = "swap", check=None) -> TrainedAndReady:
    """B = B' = 1, N = N' = 1, eta = 1, one instance at version 0, driven through the protocol:

        buffer 0  consumed: a (V 0), trained at step 0
        buffer 1  ready:    c (V 0, staleness 1 when trained)
        run version 1

    Both groups are of version 0, so each window [0, 1] holds both buffers: swapping the two
    groups' placements keeps every counter, the bound and the segment versions right."""
    check = check or (lambda: None)
    d = Driver(engine, name=name, batch_size=1, buffer_capacity=1, group_size=1, samples_per_group=1, eta=1)
    i0 = d.p.register_instance(d.run, "i0", 0)
    a, c = d.enqueue(2)
    check()
    (sa,), (sc,) = d.members(a), d.members(c)
    attempts = d.routed([sa], i0) | d.routed([sc], i0)  # a reserves buffer 1, c buffer 0
    check()
    d.finish(attempts, version=0)
    check()
    d.reward_all(rewards={sa: 0.0, sc: 1.0})  # a lands in buffer 0 (c's reservation moves to 1), c in 1
    check()
    d.train(0)
    check()
    return TrainedAndReady(d, a, c)
