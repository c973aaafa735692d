"""The processes of the backend-kills bench (bench/backend_kills.py): protocol workers that
journal every call they make, and the killer that terminates their PostgreSQL backends.

A `node` worker is one process hosting several instances (a GPU node, as `rollout-worker
--instances K`): their heartbeats and reports go in one node sync (`sync_node`) and their work
comes in one node poll (`poll_node`), each one transaction with its stored outcome, as the API
runs them. Each item of a sync is journaled as its own report (acked or refused: its outcome);
a sync whose outcome stays unknown is journaled whole (`node_sync`, its items by instance).

Each worker journals every call: `acked` (it returned), `refused` (a ProtocolError: nothing
changed) or `unknown` (the connection died: the commit may or may not have happened). Writes
that can be retried carry a request id and are retried with the same id until the outcome is
known; an instance whose reports stay unknown is abandoned, as a crashed process would be
(its lease expires and its samples go back to the queue). The journals are what
`backend_kills.check` compares with the database.
"""

from __future__ import annotations

import json
import random
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from staleflow_db import idempotency
from staleflow_db.db import make_engine
from staleflow_db.errors import Conflict, ProtocolError
from staleflow_db.protocol import NodeHeartbeat, NodeItem, Protocol
from staleflow_db.protocol.core import dumps
from staleflow_db.types import Report
from workers.wire.enums import SegmentKind
from workers.wire.types import RouteOutcome

APP = "sf-chaos"  # application_name prefix of the workers' connections: the killer's target
INSTANCE_LEASE_S = 2.0
NODE_INSTANCES = 3  # instances per `node` worker
RETRIES = 6  # same request id; beyond that the outcome stays unknown


class Unknown(Exception):
    """The connection died under the call: it may or may not have committed."""


def tok(sid: int, pos: int) -> int:
    return (sid * 7919 + pos * 31) % 50_000


def logprob(pos: int) -> float:
    return -(pos % 8) / 8


def expected(sid: int, n: int) -> list[int]:
    return [tok(sid, p) for p in range(n)]


def _disconnect(e: DBAPIError) -> bool:
    return bool(e.connection_invalidated) or isinstance(
        e.orig, (psycopg.errors.AdminShutdown, psycopg.OperationalError)
    )


class Journal:
    def __init__(self, name: str):
        self.name, self.calls, self.seq = name, [], 0

    def call(self, op: str, fn: Callable[[], Any], **meta: Any) -> Any:
        """Run one protocol call and journal its outcome; raises ProtocolError or Unknown."""
        self.seq += 1
        entry = {"op": op, "worker": self.name, "n": self.seq, **meta}
        self.calls.append(entry)
        try:
            out = fn()
        except ProtocolError as e:
            entry.update(outcome="refused", error=str(e), lost=[k for k, _ in getattr(e, "items", [])])
            raise
        except DBAPIError as e:
            entry.update(outcome="unknown" if _disconnect(e) else "failed", error=f"{type(e.orig).__name__}: {e.orig}")
            if entry["outcome"] == "failed":  # a definite rollback, but not one a kill explains
                entry["traceback"] = traceback.format_exc()
            raise Unknown(str(e.orig)) from None
        entry["outcome"] = "acked"
        return out

    def retried(self, op: str, fn: Callable[[str], Any], **meta: Any) -> Any:
        """A retryable write: the same request id until acked or refused; Unknown if never known."""
        rid = uuid.uuid4().hex
        for _ in range(RETRIES):
            try:
                return self.call(op, lambda: fn(rid), request_id=rid, **meta)
            except Unknown:
                time.sleep(0.05)
        raise Unknown(f"{op} {rid}: outcome still unknown after {RETRIES} tries")


def _scalar(engine, sql: str, **params):
    with engine.connect() as c:
        return c.execute(text(sql), params).scalar()


def worker_main(kind: str, url: str, run: int, name: str, out_dir: str, seconds: float, ops: int, seed: int) -> None:
    """Process entry point: run one role until the deadline (or `ops` calls), then write the journal."""
    j = Journal(name)
    engine = make_engine(url, pool_size=2, max_overflow=2, connect_args={"application_name": f"{APP}-{name}"})
    # The checker's own reads go through an untargeted connection: they must not be killed.
    reader = make_engine(url, pool_size=1, max_overflow=1, connect_args={"application_name": f"sf-read-{name}"})
    body = {"rollout": _rollout, "node": _node, "reward": _reward, "trainer": _trainer, "meddler": _meddler}[kind]
    deadline = time.monotonic() + seconds
    done = lambda: time.monotonic() > deadline or (ops and j.seq >= ops)  # noqa: E731
    extra: dict[str, Any] = {}
    try:
        body(Protocol(engine), reader, run, name, done, random.Random(seed), j, extra)
    except BaseException:
        extra["crash"] = traceback.format_exc()
    finally:
        engine.dispose()
        reader.dispose()
        Path(out_dir, f"{name}.json").write_text(json.dumps({"calls": j.calls, **extra}))


def _attempt(j: Journal, op: str, fn: Callable[[], Any], **meta: Any) -> Any:
    """A call whose failure is not fatal: None when refused or unknown."""
    try:
        return j.call(op, fn, **meta)
    except (ProtocolError, Unknown):
        return None


def _rollout(p: Protocol, reader, run: int, name: str, done, rng: random.Random, j: Journal, extra) -> None:
    inst = None
    while not done():
        version = _scalar(reader, "SELECT version FROM runs WHERE id = :r", r=run)
        if inst is None:
            inst = _attempt(j, "register", lambda: p.register_instance(run, name, version, INSTANCE_LEASE_S))
            if inst is None:
                continue
        try:
            j.call("heartbeat", lambda: p.heartbeat(inst, version, {"w": name}, INSTANCE_LEASE_S), instance=inst)
        except Conflict:
            inst = None  # fenced (expired): a fresh instance, as a restarted process would
            continue
        except (ProtocolError, Unknown):
            continue
        with reader.connect() as c:
            queued = (
                c.execute(
                    text(
                        "SELECT s.id FROM samples s JOIN prompt_groups g ON g.id = s.group_id WHERE s.run_id = :r"
                        " AND s.state = 'queued' AND coalesce(s.last_version, 0) <= :v AND coalesce(s.v_traj, 0) <= :v"
                        " ORDER BY g.state = 'reserved' DESC, random() LIMIT 4"
                    ),
                    {"r": run, "v": version},
                )
                .scalars()
                .all()
            )
        if not queued:
            time.sleep(0.02)
            continue
        try:
            results = j.retried(
                "route",
                lambda rid: p.route(run, [(s, inst) for s in queued], request_id=rid),
                pairs=[[s, inst] for s in queued],
            )
        except (ProtocolError, Unknown):
            continue
        j.calls[-1]["routed"] = [[r.sample_id, r.attempt] for r in results if r.outcome == RouteOutcome.ROUTED]
        try:
            work = j.call("poll", lambda: p.poll_work(inst), instance=inst).work
        except (ProtocolError, Unknown):
            continue  # delivered-or-not: the samples stay ours until the lease expires
        for w in work:
            if not _generate(p, run, inst, version, w, rng, j):
                extra.setdefault("abandoned", []).append(inst)
                inst = None  # reports stayed unknown: behave as a crashed process
                break
    if inst is not None:
        _attempt(j, "deregister", lambda: p.deregister_instance(inst), instance=inst)


def _generate(p: Protocol, run: int, inst: int, version: int, w, rng: random.Random, j: Journal) -> bool:
    """Report a partial checkpoint and a final segment; False if an outcome stayed unknown."""
    pos, left = len(w.prefix_tokens), w.max_new_tokens
    if w.prefix_tokens != expected(w.sample_id, pos):
        j.calls.append({"op": "prefix", "outcome": "mismatch", "sample": w.sample_id, "worker": j.name})
    plan = []
    if rng.random() < 0.3 and left > 4:
        plan.append((SegmentKind.PARTIAL, rng.randint(1, 3)))
    plan.append(
        (SegmentKind.INTERRUPTED, rng.randint(0, 4))
        if w.attempt < 3 and rng.random() < 0.3
        else (SegmentKind.FINISHED, rng.randint(1, 6))
    )
    for kind, n in plan:
        n = min(n, left)
        toks, lps = expected(w.sample_id, pos + n)[pos:], [logprob(i) for i in range(pos, pos + n)]
        r = Report(
            w.sample_id,
            w.attempt,
            version,
            toks,
            lps,
            kind,
            "stop" if kind == SegmentKind.FINISHED else None,
            instance_id=inst,
            route_token=w.route_token,
        )
        try:
            j.retried(
                "report",
                lambda rid: p.report(run, [r], request_id=rid),
                items=[[w.sample_id, w.attempt, toks]],
                kind=kind.value,
            )
        except ProtocolError:
            return True  # the route is gone (aborted, interrupted, expired): drop the sample
        except Unknown:
            return False
        pos, left = pos + n, left - n
    return True


def _queued(reader, run: int, version: int, n: int) -> list[int]:
    with reader.connect() as c:
        return list(
            c.execute(
                text(
                    "SELECT s.id FROM samples s JOIN prompt_groups g ON g.id = s.group_id WHERE s.run_id = :r"
                    " AND s.state = 'queued' AND coalesce(s.last_version, 0) <= :v AND coalesce(s.v_traj, 0) <= :v"
                    " ORDER BY g.state = 'reserved' DESC, random() LIMIT :n"
                ),
                {"r": run, "v": version, "n": n},
            )
            .scalars()
            .all()
        )


def _plain(value: Any) -> Any:
    """As the stored outcome reads back (JSON): a fresh outcome and a replayed one alike."""
    return json.loads(dumps(value))


def _node(p: Protocol, reader, run: int, name: str, done, rng: random.Random, j: Journal, extra) -> None:
    """NODE_INSTANCES instances in one process: one node sync for their heartbeats, one node
    poll for their work, then their segments in rounds of one node sync each."""
    slots: list[int | None] = [None] * NODE_INSTANCES
    while not done():
        version = _scalar(reader, "SELECT version FROM runs WHERE id = :r", r=run)
        for k, iid in enumerate(slots):
            if iid is None:
                slots[k] = _attempt(
                    j, "register", lambda: p.register_instance(run, f"{name}-{k}", version, INSTANCE_LEASE_S)
                )
        live = [i for i in slots if i is not None]
        if not live:
            continue
        beats = [NodeItem(i, heartbeat=NodeHeartbeat(version, {"w": name}, INSTANCE_LEASE_S)) for i in live]
        try:
            outcomes = _sync(p, run, j, beats, {})
        except (ProtocolError, Unknown):
            continue
        fenced = {o["instance_id"] for o in outcomes if o["refused"] is not None}
        slots = [None if i in fenced else i for i in slots]  # a fresh instance, as a restarted node would
        live = [i for i in live if i not in fenced]
        queued = _queued(reader, run, version, 2 * len(live)) if live else []
        if not queued:
            time.sleep(0.02)
            continue
        pairs = [(s, live[k % len(live)]) for k, s in enumerate(queued)]
        try:
            results = j.retried(
                "route", lambda rid: p.route(run, pairs, request_id=rid), pairs=[list(x) for x in pairs]
            )
        except (ProtocolError, Unknown):
            continue
        j.calls[-1]["routed"] = [[r.sample_id, r.attempt] for r in results if r.outcome == RouteOutcome.ROUTED]
        try:
            deliveries = j.retried("node_poll", lambda rid: _poll(p, live, rid), instances=live)
        except (ProtocolError, Unknown):
            continue  # delivered-or-not: the samples stay ours until the leases expire
        fenced = {d["instance_id"] for d in deliveries if d["refused"] is not None}
        works = [
            {**w, "instance_id": d["instance_id"]}
            for d in deliveries
            if d["refused"] is None
            for w in d["poll"]["work"]
        ]
        if works:
            lapsed = _generate_node(p, run, version, works, rng, j)
            if lapsed is None:  # a sync's outcome stayed unknown: behave as a crashed node
                extra.setdefault("abandoned", []).extend(i for i in slots if i is not None)
                slots = [None] * NODE_INSTANCES
                continue
            fenced |= lapsed
        slots = [None if i in fenced else i for i in slots]
    for iid in slots:
        if iid is not None:
            _attempt(j, "deregister", lambda: p.deregister_instance(iid), instance=iid)


def _poll(p: Protocol, ids: list[int], rid: str) -> list[dict[str, Any]]:
    """A node poll in one transaction; a delivery is stored under `rid` (a retry gets it back)."""

    def delivered(out: list[dict[str, Any]]) -> bool:
        return any(d["poll"]["work"] or d["poll"]["commands"] for d in out)

    out, _ = idempotency.once(
        p.engine,
        rid,
        "node_poll",
        idempotency.digest(ids),
        lambda c: _plain(p.poll_node(ids, conn=c)),
        json.dumps,
        lambda stored: stored,
        store=delivered,
    )
    return out


def _sync(p: Protocol, run: int, j: Journal, items: list[NodeItem], segs: dict[int, list]) -> list[dict[str, Any]]:
    """One node sync, retried under one request id. `segs`: by instance, the [sample, attempt,
    tokens] of its item's reports, each journaled as a report with its item's outcome."""
    parts = {str(it.instance_id): segs.get(it.instance_id, []) for it in items}
    outcomes: list[dict[str, Any]] = j.retried(
        "node_sync",
        lambda rid: p.idempotent(
            rid, "node_sync", lambda c: _plain(p.sync_node(run, items, conn=c)), lambda o: o, body=[run, items]
        ),
        parts=parts,
    )
    rid = j.calls[-1]["request_id"]
    for o in outcomes:
        for seg in segs.get(o["instance_id"], []):
            entry = {"op": "report", "worker": j.name, "n": j.seq, "request_id": rid, "items": [seg], "node": True}
            if o["refused"] is None:
                j.calls.append({**entry, "outcome": "acked"})
            else:
                lost = [i for i, _ in o["refused"]]
                j.calls.append({**entry, "outcome": "refused", "error": o["message"], "lost": lost})
    return outcomes


def _generate_node(
    p: Protocol, run: int, version: int, works: list[dict], rng: random.Random, j: Journal
) -> set[int] | None:
    """Every delivered sample's segments (maybe a partial checkpoint, then a final one) in
    rounds of one node sync: each instance's item carries one segment of each of its samples,
    sometimes with a heartbeat. A refused item's samples whose route is lost are dropped, the
    others of the item go again in the next round; a fenced instance's all go. Returns the
    fenced instances; None if a sync's outcome stayed unknown."""
    plans: dict[int, list[Any]] = {}  # sample -> [work, position, tokens left, segments to send]
    for w in works:
        pos = len(w["prefix_tokens"])
        if w["prefix_tokens"] != expected(w["sample_id"], pos):
            j.calls.append({"op": "prefix", "outcome": "mismatch", "sample": w["sample_id"], "worker": j.name})
        plan = []
        if rng.random() < 0.3 and w["max_new_tokens"] > 4:
            plan.append((SegmentKind.PARTIAL, rng.randint(1, 3)))
        plan.append(
            (SegmentKind.INTERRUPTED, rng.randint(0, 4))
            if w["attempt"] < 3 and rng.random() < 0.3
            else (SegmentKind.FINISHED, rng.randint(1, 6))
        )
        plans[w["sample_id"]] = [w, pos, w["max_new_tokens"], plan]
    fenced: set[int] = set()
    while plans:
        reports: dict[int, list[Report]] = defaultdict(list)
        segs: dict[int, list] = defaultdict(list)
        sizes = {}
        for sid, (w, pos, left, plan) in plans.items():
            kind, n = plan[0]
            n = sizes[sid] = min(n, left)
            toks, lps = expected(sid, pos + n)[pos:], [logprob(i) for i in range(pos, pos + n)]
            iid, final = w["instance_id"], "stop" if kind == SegmentKind.FINISHED else None
            reports[iid].append(
                Report(
                    sid, w["attempt"], version, toks, lps, kind, final, instance_id=iid, route_token=w["route_token"]
                )
            )
            segs[iid].append([sid, w["attempt"], toks])
        items = [
            NodeItem(
                iid,
                rs,
                {"w": "node"},
                NodeHeartbeat(version, {"w": "node"}, INSTANCE_LEASE_S) if rng.random() < 0.3 else None,
            )
            for iid, rs in sorted(reports.items())
        ]
        try:
            outcomes = _sync(p, run, j, items, segs)
        except ProtocolError:
            return fenced  # refused whole: drop these samples (their routes go with the leases)
        except Unknown:
            return None
        lost: set[int] = set()
        for o in outcomes:
            if o["refused"] is not None:
                named = {i for i, _ in o["refused"]} & {r.sample_id for r in reports[o["instance_id"]]}
                lost |= named or {r.sample_id for r in reports[o["instance_id"]]}
                if not named:
                    fenced.add(o["instance_id"])
        refused = {o["instance_id"] for o in outcomes if o["refused"] is not None}
        for sid in list(plans):
            v = plans[sid]
            if sid in lost:
                del plans[sid]
            elif v[0]["instance_id"] not in refused:  # applied: the next segment, if any
                v[3].pop(0)
                v[1], v[2] = v[1] + sizes[sid], v[2] - sizes[sid]
                if not v[3]:
                    del plans[sid]
    return fenced


def _reward(p: Protocol, reader, run: int, name: str, done, rng: random.Random, j: Journal, extra) -> None:
    while not done():
        tasks = _attempt(j, "claim", lambda: p.claim_rewards(run, limit=8, claim_seconds=3.0))
        if not tasks:
            time.sleep(0.03)
            continue
        j.calls[-1]["claimed"] = [[t.sample_id, t.reward_attempt] for t in tasks]
        pending = [(t.sample_id, t.reward_attempt, float(rng.choice([0, 1])) + t.reward_attempt / 1000) for t in tasks]
        while pending:
            try:
                j.retried(
                    "reward",
                    lambda rid: p.record_rewards(run, pending, request_id=rid),
                    items=[list(x) for x in pending],
                )
                break
            except Conflict as e:  # aborted meanwhile: drop those, retry the rest
                lost = {sid for sid, _ in e.items}
                pending = [x for x in pending if x[0] not in lost]
            except (ProtocolError, Unknown):
                break  # the claim runs out and another claim scores them


def _trainer(p: Protocol, reader, run: int, name: str, done, rng: random.Random, j: Journal, extra) -> None:
    v = _scalar(reader, "SELECT version FROM runs WHERE id = :r", r=run)
    while not done():
        _attempt(j, "expire", lambda: p.expire_instances(run))
        _attempt(j, "abort_after_ready", lambda: p.abort_after_ready(run))
        batch = _attempt(j, "consume", lambda: p.consume(run, v), version=v)
        if batch is None:
            time.sleep(0.03)
            continue
        j.calls[-1]["consume_fence"] = batch.consume_fence
        for _try in range(RETRIES):
            checksum = f"{name}-v{v}-{uuid.uuid4().hex[:8]}"  # unique per call: tells whose publish landed
            try:
                new = j.call(
                    "publish",
                    lambda: p.publish(run, v, batch.consume_fence, 1, checksum, "bench"),
                    version=v,
                    checksum=checksum,
                    consume_fence=batch.consume_fence,
                )
            except Unknown:
                continue
            except ProtocolError:
                break
            v = new
            break
        v = _scalar(reader, "SELECT version FROM runs WHERE id = :r", r=run)


def _meddler(p: Protocol, reader, run: int, name: str, done, rng: random.Random, j: Journal, extra) -> None:
    """Interrupts running samples, aborts a few queued samples and groups (user aborts)."""
    while not done():
        time.sleep(rng.uniform(0.05, 0.2))
        with reader.connect() as c:
            running = (
                c.execute(
                    text("SELECT id FROM samples WHERE run_id = :r AND state = 'running' ORDER BY random() LIMIT 3"),
                    {"r": run},
                )
                .scalars()
                .all()
            )
            queued = (
                c.execute(
                    text("SELECT id FROM samples WHERE run_id = :r AND state = 'queued' ORDER BY random() LIMIT 1"),
                    {"r": run},
                )
                .scalars()
                .all()
            )
        if running:
            _attempt(j, "interrupt", lambda: p.interrupt(run, running), samples=running)
        if queued and rng.random() < 0.15:
            aborted = _attempt(j, "abort", lambda: p.abort_samples(run, queued), samples=queued)
            if aborted is not None:
                j.calls[-1]["aborted"] = aborted
        if rng.random() < 0.05:
            with reader.connect() as c:
                gid = c.execute(
                    text(
                        "SELECT id FROM prompt_groups WHERE run_id = :r AND state = 'queued' ORDER BY random() LIMIT 1"
                    ),
                    {"r": run},
                ).scalar()
            if gid is not None and _attempt(j, "abort_group", lambda: p.abort_group(run, gid), group=gid):
                j.calls[-1]["aborted_group"] = gid


def killer_main(url: str, out_dir: str, seconds: float, seed: int) -> None:
    """Terminate the workers' backends at random moments; journal what was hit in which state."""
    rng, kills = random.Random(seed), defaultdict(int)
    deadline = time.monotonic() + seconds
    with psycopg.connect(url, autocommit=True, application_name="sf-killer") as c:
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.02, 0.35))
            rows = c.execute(
                "SELECT pid, state FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND application_name LIKE %s",
                (APP + "%",),
            ).fetchall()
            busy = [r for r in rows if r[1] in ("active", "idle in transaction")]
            targets = busy if busy and rng.random() < 0.7 else rows  # prefer mid-transaction / commit
            for pid, state in rng.sample(targets, k=min(len(targets), rng.randint(1, 3))):
                if c.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]:
                    kills[state or "unknown"] += 1
    Path(out_dir, "killer.json").write_text(json.dumps({"kills": kills}))
