"""The load of `bench/capacity.py`: Locust users (gevent greenlets) that follow the real workers'
cadence over REST, with the requests and responses built from the `workers.wire` models.

* `Instance` is a rollout instance as `workers/rollout/worker.py` runs one: it registers with its
  capacity, keeps a long-poll open for work and commands (the inbox greenlet, `poll_wait_s`),
  reports when a segment ends (coalesced over 50 ms, one call for all its samples) or a
  checkpoint is due (every held sample as a partial segment every `checkpoint_s`: the time its
  samples take to decode the worker's `CHECKPOINT_TOKENS`, at most `CHECKPOINT_EVERY_S`; 80% due,
  it rides a report that goes anyway), a report carrying the snapshot at most once a `heartbeat_s`. Polls
  and reports renew the lease, so it heartbeats only for a snapshot a report left out (a second
  later), none sent for `snapshot_every_s` while it holds samples, or no call at all for half
  a lease; on a pull command it interrupts what it holds, reports it and heartbeats the new
  version. Its reports' token ids and log-probs go packed, as the worker's client sends them
  (`wire` "lists": JSON lists). Instead of an engine it holds `slots` samples, each generating
  `tokens_per_s` tokens (the cost model's per-sample decode rate) for an exponentially drawn
  lifetime whose mean keeps the instance at the cost model's sample rate; an agentic sample
  (`turns` > 1) ends each turn but the last as the real worker with an environment does: a partial segment, the observation (not generated), and back to the queue
  to be routed again for the next turn.
* `Coordinator` (one, in the first load process): keeps prompts queued (enqueued in the chunks
  `staleflow enqueue` sends), routes queued samples
  to instances with free slots (from the run's snapshot, read as what changed since its last
  read and merged into a `SnapshotMirror`, as the live coordinator reads it) and sends a pull to every instance when
  the trainer publishes a version; records when it sent each pull, so command delivery is
  measured as (instance's poll returned) - (pull sent), across processes on one clock.
* `Node` (with `per_node` K > 1, instead of `Instance`): a process hosting K instances as
  workers/rollout/node.py runs them: one long-poll for all K and one sync carrying all their
  reports and heartbeats whenever any has a report due (one report timer for the node) or owes
  a heartbeat; each member instance follows `Instance`'s engine side (`Held`).
* `Rewarder` claims (long-poll) and records rewards, lingering after a claim that took less than
  its batch as the reward worker does (`claim_linger_s`); `Trainer` consumes (long-poll), trains for
  `train_seconds` and publishes.

Run as a child of bench/capacity.py (one per load process):

    python bench/capacity_users.py CONFIG.json OUT.json

CONFIG: hosts, tokens by role, run, counts, the cadence figures, `start_at`/`end_at` (epoch
seconds: the stats are reset at start_at and written at end_at). OUT: per endpoint
{calls, failures, response_times histogram (ms)}, command deliveries, lapses (an instance's call
refused with 409: its lease lapsed), finished samples.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import json
import math
import random
import struct
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from gevent import monkey

monkey.patch_all()

import gevent
from gevent.event import Event
from locust import FastHttpUser, constant, task
from locust.env import Environment

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

from workers.wire import models as m
from workers.wire.enums import SegmentKind
from workers.wire.packed import FLOAT32, INT32, PACKED_CONTEXT, PackedArray
from workers.wire.snapshot_mirror import SnapshotMirror

CFG: dict = {}
SHARED = {
    "version": 0,
    "pulled": 0,
    "pulls": {},
    "deliveries": [],
    "lapses": 0,
    "finished": 0,
    "tokens": 0,  # generated tokens the reports that went through carried
    "errors": [],
    "crashes": 0,
}
_HOSTS = itertools.count()
# the instances serving now (registered, until their task ends), whose held samples hold the
# tokens generated but not yet reported at the window's edges (a window of ~one checkpoint
# interval would otherwise count what checkpoints hold back)
ENGINES: set = set()
# An instance acts at the ends of its engine steps (every STEP_S, from its own start: the
# instances' steps out of phase, as real engines' are). With nothing due (no turn ends, no
# report, checkpoint or heartbeat falls due, no delivery) it sleeps through the steps until the
# next thing is: a node woke 100 times a second, mostly to find nothing due, on the cores the
# server under test shares. A delivery wakes it for the end of the step it arrived in;
# IDLE_MAX_S bounds the sleep.
STEP_S, IDLE_MAX_S = 0.01, 0.25


def sleep_until_due(wake: Event, due: float, phase: float) -> None:
    """Until `due` or a delivery (`wake`), then to the end of that engine step."""
    wake.wait(min(IDLE_MAX_S, max(0.0, due - time.monotonic())))
    wake.clear()
    gevent.sleep(STEP_S - (time.monotonic() - phase) % STEP_S)


# payloads drawn from pools of random values: token ids and log-probs as incompressible as real
# ones (TOAST compresses a repeated value to almost nothing), sliced at a random offset per segment;
# with the wire `packed` (the worker's client's default) they stay packed (workers.wire.packed) from
# the pool to the request body, as the client's are from its arrays
_RNG = random.Random(0)
TOKEN_POOL = [_RNG.randrange(150_000) for _ in range(1 << 16)]
LOGPROB_POOL = [-_RNG.expovariate(1.0) for _ in range(1 << 16)]
TOKEN_BYTES = struct.pack(f"<{len(TOKEN_POOL)}i", *TOKEN_POOL)
LOGPROB_BYTES = struct.pack(f"<{len(LOGPROB_POOL)}f", *LOGPROB_POOL)


def payload(n: int) -> tuple[Sequence, Sequence]:
    at = random.randrange(len(TOKEN_POOL) - n) if n < len(TOKEN_POOL) else 0
    if CFG.get("wire") == "lists":
        return TOKEN_POOL[at : at + n], LOGPROB_POOL[at : at + n]
    return PackedArray(TOKEN_BYTES[4 * at : 4 * (at + n)], INT32), PackedArray(
        LOGPROB_BYTES[4 * at : 4 * (at + n)], FLOAT32
    )


def packed_query() -> str:
    """The claim's and the consume's query: arrays packed, as the client asks for them (the wire
    `lists`: JSON lists)."""
    return "" if CFG.get("wire") == "lists" else "&packed=true"


def joined(a: Sequence, b: Sequence) -> Sequence:
    """Two stretches of one sample's output as one segment's array."""
    if isinstance(a, PackedArray) and isinstance(b, PackedArray):
        return PackedArray(a.raw + b.raw, a.kind)
    return list(a) + list(b)


def report_in(r: dict) -> m.ReportIn:
    """A pending report as the request model, built without validation (its values are the load
    generator's own, and the API validates the body): packed arrays go to the body as they are,
    base64-encoded once, where validating them decoded and checked them first."""
    return m.ReportIn.model_construct(**{**r, "kind": SegmentKind(r["kind"])})


def unsent(now: float) -> float:
    """Tokens the held samples generated since their last segment."""
    rate, most = CFG["tokens_per_s"], CFG["max_tokens"]
    return sum(min(rate * (now - h["since"]), most - h["done"]) for e in ENGINES for h in e.held.values())


class Api(FastHttpUser):
    """One simulated process of a role: its own token, spread over the replicas in turn."""

    abstract = True
    role = "admin"
    wait_time = constant(0)
    concurrency = 4  # the inbox greenlet and the main loop share the connection pool

    def __init__(self, environment):
        hosts = CFG["hosts"]
        self.host = hosts[next(_HOSTS) % len(hosts)]
        super().__init__(environment)
        self.run_id = CFG["run"]
        self.auth = {"Authorization": f"Bearer {CFG['tokens'][self.role]}"}

    def call(
        self, name: str, path: str, body=None, out=None, params: str = "", key: bool = False, method="POST", raw=False
    ):
        """One REST call; the parsed `out` model (`raw`: the decoded JSON), or None when it failed
        (counted by Locust)."""
        headers = dict(self.auth)
        if key:
            headers["Idempotency-Key"] = uuid.uuid4().hex
        data = None
        if body is not None:
            context = PACKED_CONTEXT if CFG.get("wire") != "lists" else None
            data = body.model_dump_json(exclude_none=True, context=context).encode()
            headers["Content-Type"] = "application/json"
        url = f"/v1/runs/{self.run_id}{path}{params}"
        with self.client.request(method, url, data=data, headers=headers, name=name, catch_response=True) as r:
            if r.status_code == 409 and self.role == "rollout":
                SHARED["lapses"] += 1  # an instance's call refused: its lease lapsed
            if r.status_code >= 400 or r.status_code == 0:
                text = (r.text or "")[:200] if r.status_code else str(r.error)
                r.failure(f"{r.status_code} {text}")
                if len(SHARED["errors"]) < 10:
                    SHARED["errors"].append(f"{name}: {r.status_code} {text}")
                return None
            if raw:
                return json.loads(r.content)
            return out.model_validate_json(r.content) if out is not None else True


class Held:
    """One simulated instance's samples and the reports it owes (no calls of its own): the
    engine side shared by `Instance` (its own calls) and `Node`'s members (the node's syncs)."""

    capacity: m.Capacity
    version: int
    held: dict[int, dict]
    # (turn end, sample id) of every delivered turn, soonest first: an engine step looks only at
    # the turns that ended (a scan of every held sample each 10-ms step took a third of the
    # load generator's CPU at 128 instances of 85 samples); entries of samples that left are skipped
    ends: list[tuple[float, int]]
    pending: list[dict]
    due: float  # when the earliest pending report falls due (a finish's slack)
    instance: int
    last: dict[str, float]
    owed: bool

    def deliver(self, out: m.PollOut, now: float):
        c = CFG
        for w in out.work:
            life = min(random.expovariate(c["sample_rate"] / c["slots"]), c["max_tokens"] / c["tokens_per_s"])
            # turns answered so far: one observation (a run of mask-0 tokens) each
            done_turns = sum(1 for a, b in zip([1, *w.prefix_mask], w.prefix_mask, strict=False) if a and not b)
            self.held[w.sample_id] = {
                "attempt": w.attempt,
                "token": w.route_token,
                "routed": now,  # the stretch's start: a finish's slack is a share of its time
                "since": now,  # tokens since the last segment accrue from here
                "done": len(w.prefix_tokens),
                "turn_len": life / c["turns"],
                "turn_end": now + life / c["turns"],
                "turns_left": max(1, c["turns"] - done_turns),
            }
            heapq.heappush(self.ends, (self.held[w.sample_id]["turn_end"], w.sample_id))
        for cmd in out.commands:
            if cmd.kind == "pull":  # one version per segment: interrupt all, report, load, heartbeat
                for sid in list(self.held):
                    self.segment(sid, now, "interrupted")
                self.flush()
                self.heartbeat(pulling=True)
                self.version = max(self.version, cmd.target_version or 0)
                self.heartbeat()
            elif cmd.sample_id in self.held and self.held[cmd.sample_id]["attempt"] == cmd.attempt:
                self.segment(cmd.sample_id, now, "interrupted" if cmd.kind == "interrupt" else None)

    def next_turn_end(self) -> float:
        return self.ends[0][0] if self.ends else math.inf

    def next_snapshot_due(self) -> float:
        """When this instance's snapshot falls due: stale progress, or one owed since a report."""
        at = math.inf
        if self.held:
            at = self.last["snapshot"] + CFG["snapshot_every_s"]
        if self.owed:
            at = min(at, self.last["snapshot"] + CFG["heartbeat_s"])
        return at

    def end_turns(self, now: float):
        """End every held turn whose time has come."""
        ends, held = self.ends, self.held
        while ends and ends[0][0] <= now:
            at, sid = heapq.heappop(ends)
            h = held.get(sid)
            if h is not None and h["turn_end"] == at:
                self.end_turn(sid, now)

    def end_turn(self, sid: int, now: float):
        """As the real worker with an environment: a turn that is not the last reports what it
        generated (partial), then the observation (not generated), and goes back to the queue."""
        h = self.held[sid]
        room = CFG["max_tokens"] - h["done"] - CFG["observation_tokens"] - 2
        if h["turns_left"] <= 1 or room <= 0:  # a trajectory never ends on an observation
            self.segment(sid, now, "finished")
            return
        self.segment(sid, now, "partial", least=1)
        self.pending.append(
            {
                "sample_id": sid,
                "attempt": h["attempt"],
                "route_token": h["token"],
                "version": None,
                "tokens": [5] * CFG["observation_tokens"],
                "logprobs": [],
                "kind": "interrupted",
                "finish_reason": None,
                "generated": False,
            }
        )
        self.due = min(self.due, now)
        del self.held[sid]

    def segment(self, sid: int, now: float, kind: str | None, least: int = 0):
        """Queue what `sid` generated since its last segment; kind None: aborted, nothing sent."""
        h = self.held[sid]
        n = int((now - h["since"]) * CFG["tokens_per_s"])
        n = max(1 if kind == "finished" else least, min(n, CFG["max_tokens"] - h["done"]))
        h["since"], h["done"] = now, h["done"] + n
        if kind != "partial":
            del self.held[sid]
        if kind is None:
            self.pending = [r for r in self.pending if r["sample_id"] != sid]
            return
        # the worker's rule: a finish waits for company, at most a share of its stretch's time
        slack = min(CFG["finish_slack_max_s"], CFG["finish_slack_share"] * (now - h["routed"]))
        self.due = min(self.due, now + (slack if kind == "finished" else 0.0))
        prev = next((r for r in reversed(self.pending) if r["sample_id"] == sid), None)
        tokens, logprobs = payload(n)
        if prev is not None and prev["kind"] == "partial" and prev["version"] == self.version:
            prev["tokens"] = joined(prev["tokens"], tokens)
            prev["logprobs"] = joined(prev["logprobs"], logprobs)
            prev["kind"] = kind
            return
        if n == 0 and kind == "partial":
            return
        self.pending.append(
            {
                "sample_id": sid,
                "attempt": h["attempt"],
                "route_token": h["token"],
                "version": self.version,
                "tokens": tokens,
                "logprobs": logprobs,
                "kind": kind,
                "finish_reason": "stop" if kind == "finished" else None,
            }
        )

    def snapshot(self, pulling: bool = False) -> m.InstanceSnapshotIn:
        c = CFG
        # built without validation, as `report_in`, and kept per sample until its progress
        # changes (a segment every checkpoint; a snapshot goes about every second)
        running = []
        for s, h in self.held.items():
            entry = h.get("entry")
            if entry is None or entry.tokens != h["done"]:
                entry = h["entry"] = m.RunningSampleIn.model_construct(sample_id=s, tokens=h["done"])
            running.append(entry)
        kv = sum(h["done"] + c["prompt_tokens"] for h in self.held.values())
        return m.InstanceSnapshotIn.model_construct(
            running=len(self.held),
            kv_used=kv,
            running_samples=running,
            capacity=self.capacity,
            throughput=c["tokens_per_s"] * len(self.held),
            pulling=pulling,
        )

    def flush(self) -> None:
        raise NotImplementedError

    def heartbeat(self, pulling: bool = False) -> None:
        raise NotImplementedError


class Instance(Api, Held):
    role = "rollout"

    @task
    def serve(self):
        c = CFG
        self.capacity = m.Capacity(max_running=c["slots"], kv_capacity=c["kv_capacity"])
        self.version = SHARED["version"]
        self.held: dict[int, dict] = {}
        self.ends = []
        self.pending: list[dict] = []  # report items not sent yet, batched as the real worker
        self.due = math.inf
        self.inbox: list[m.PollOut] = []
        self.wake = Event()  # a delivery arrived
        if not self.register():
            gevent.sleep(1)
            return
        now = time.monotonic()
        # registration sent the capacity: the first snapshot; checkpoints spread over the interval
        self.last = {"heartbeat": now, "report": 0.0, "snapshot": now, "poll": now}
        self.owed = False  # a report went without the snapshot
        checkpoint = now - random.uniform(0, c["checkpoint_s"])
        poller = gevent.spawn(self.poll_loop)
        ENGINES.add(self)
        try:
            phase = time.monotonic() + random.uniform(0, STEP_S)  # its steps out of phase with the others
            while True:
                sleep_until_due(self.wake, self.next_due(checkpoint), phase)
                now = time.monotonic()
                for out in self.inbox:
                    self.deliver(out, now)
                self.inbox.clear()
                self.end_turns(now)
                since = now - checkpoint
                reporting = bool(self.pending) and now >= max(self.last["report"] + c["report_s"], self.due)
                if since >= c["checkpoint_s"] or (reporting and since >= c["checkpoint_s"] * 0.8):
                    checkpoint = now  # due, or nearly and a report goes anyway: it rides along
                    for sid in list(self.held):
                        self.segment(sid, now, "partial")
                if self.pending and now >= max(self.last["report"] + c["report_s"], self.due):
                    self.flush()
                # a heartbeat only for what nothing else carried (the worker's `_heartbeat_due`;
                # no preemption or environment wait here, so no unpredictable change)
                quiet = now - max(self.last["report"], self.last["heartbeat"], self.last["poll"])
                since = now - self.last["snapshot"]
                stale = since >= c["snapshot_every_s"] and bool(self.held)
                if quiet >= c["lease_s"] / 2 or stale or (self.owed and since >= c["heartbeat_s"]):
                    self.heartbeat()
        finally:
            poller.kill()
            ENGINES.discard(self)

    def next_due(self, checkpoint: float) -> float:
        """The earliest time the loop below has something to do (see STEP_S)."""
        c, last = CFG, self.last
        at = min(self.next_turn_end(), checkpoint + c["checkpoint_s"], self.next_snapshot_due())
        if self.pending:
            at = min(at, max(last["report"] + c["report_s"], self.due))
        return min(at, max(last["report"], last["heartbeat"], last["poll"]) + c["lease_s"] / 2)

    def register(self) -> bool:
        body = m.RegisterIn(name="capacity", version=self.version, lease_seconds=CFG["lease_s"], capacity=self.capacity)
        got = self.call("register", "/instances", body, m.RegisterOut, key=True)
        if got is None:
            return False
        self.instance = got.instance_id
        return True

    def poll_loop(self):
        while True:
            self.last["poll"] = time.monotonic()
            out = self.call(
                "poll (long-poll)",
                f"/instances/{self.instance}/poll",
                None,
                m.PollOut,
                params=f"?wait={CFG['poll_wait_s']}&limit=1000",
                key=True,
            )
            if out is None:
                gevent.sleep(0.1)
            elif out.work or out.commands:
                at = time.time()
                for cmd in out.commands:
                    if cmd.kind == "pull" and cmd.target_version is not None:
                        SHARED["deliveries"].append((cmd.target_version, self.instance, at))
                self.inbox.append(out)
                self.wake.set()

    def flush(self):
        if not self.pending:
            return
        items, self.pending = self.pending, []
        self.due = math.inf
        while items:  # one report per sample per batch: a turn and its observation go in two, in order
            batch, later, seen = [], [], set()
            for r in items:
                (later if r["sample_id"] in seen else batch).append(r)
                seen.add(r["sample_id"])
            # the last call carries the snapshot when one is due (at most one a heartbeat_s)
            due = time.monotonic() - self.last["snapshot"] >= CFG["heartbeat_s"]
            snap = self.snapshot() if not later and due else None
            body = m.ReportsIn(reports=[report_in(r) for r in batch], snapshot=snap)
            if self.call("report", f"/instances/{self.instance}/segments", body, m.ReportsOut, key=True) is not None:
                SHARED["finished"] += sum(r["kind"] == "finished" for r in batch)
                SHARED["tokens"] += sum(len(r["tokens"]) for r in batch)
            items = later
            if snap is not None:
                self.last["snapshot"], self.owed = time.monotonic(), False
            elif not later:
                self.owed = True  # a report went without it: one is owed within heartbeat_s
        self.last["report"] = time.monotonic()

    def heartbeat(self, pulling: bool = False):
        body = m.HeartbeatIn(version=self.version, snapshot=self.snapshot(pulling), lease_seconds=CFG["lease_s"])
        self.call("heartbeat", f"/instances/{self.instance}/heartbeat", body, m.HeartbeatOut)
        self.last["heartbeat"] = self.last["snapshot"] = time.monotonic()
        self.owed = False


class Member(Held):
    """An instance of a `Node`: its calls are the node's. A forced flush or a heartbeat (a pull)
    is queued for the node's next sync, sent at once."""

    def __init__(self, node: Node):
        self.node = node
        self.capacity = m.Capacity(max_running=CFG["slots"], kv_capacity=CFG["kv_capacity"])
        self.version: int = SHARED["version"]  # type: ignore[assignment]
        self.held, self.pending, self.ends = {}, [], []
        self.due = math.inf
        self.heartbeats: list[m.HeartbeatIn] = []  # owed, in order: one per sync
        self.instance = 0
        self.owed = False

    def flush(self) -> None:
        self.node.urgent = True

    def heartbeat(self, pulling: bool = False) -> None:
        self.heartbeats.append(
            m.HeartbeatIn(version=self.version, snapshot=self.snapshot(pulling), lease_seconds=CFG["lease_s"])
        )
        self.node.urgent = True


class Node(Api):
    """A process hosting `per_node` instances as workers/rollout/node.py runs them: one long-poll
    for all of them (POST .../instances/sync?wait=), and one sync for all their reports and
    heartbeats whenever any has a report due (the node's one report timer) or a heartbeat."""

    role = "rollout"

    @task
    def serve(self):
        c = CFG
        members = [Member(self) for _ in range(c["per_node"])]
        self.urgent = False
        self.inbox: list[tuple[Member, m.PollOut]] = []
        self.wake = Event()  # a delivery arrived
        for mem in members:
            body = m.RegisterIn(name="capacity", version=mem.version, lease_seconds=c["lease_s"], capacity=mem.capacity)
            got = self.call("register", "/instances", body, m.RegisterOut, key=True)
            if got is None:
                gevent.sleep(1)
                return
            mem.instance = got.instance_id
        now = time.monotonic()
        self.last_report = 0.0
        self.last_poll = now
        for mem in members:
            mem.last = {"heartbeat": now, "report": 0.0, "snapshot": now, "poll": now}
            mem.checkpoint = now - random.uniform(0, c["checkpoint_s"])
        self.members = members
        poller = gevent.spawn(self.poll_loop)
        ENGINES.update(members)
        try:
            phase = time.monotonic() + random.uniform(0, STEP_S)  # its steps out of phase with the others
            while True:
                sleep_until_due(self.wake, self.next_due(), phase)
                now = time.monotonic()
                for mem, out in self.inbox:
                    mem.deliver(out, now)
                self.inbox.clear()
                for mem in members:
                    mem.end_turns(now)
                # a flush goes anyway: every member's checkpoint 80% due rides it
                reporting = now - self.last_report >= c["node_report_s"] and any(
                    mem.pending and now >= mem.due for mem in members
                )
                hb = False
                for mem in members:
                    since = now - mem.checkpoint
                    if since >= c["checkpoint_s"] or (reporting and since >= c["checkpoint_s"] * 0.8):
                        mem.checkpoint = now
                        for sid in list(mem.held):
                            mem.segment(sid, now, "partial")
                    quiet = now - max(self.last_report, mem.last["heartbeat"], self.last_poll)
                    since = now - mem.last["snapshot"]
                    stale = since >= c["snapshot_every_s"] and bool(mem.held)
                    if not mem.heartbeats and (
                        quiet >= c["lease_s"] / 2 or stale or (mem.owed and since >= c["heartbeat_s"])
                    ):
                        mem.heartbeat()
                        hb = True
                if self.urgent or hb or reporting:
                    self.flush_all()
        finally:
            poller.kill()
            ENGINES.difference_update(members)

    def next_due(self) -> float:
        """The earliest time the loop above has something to do (see STEP_S)."""
        c, at = CFG, math.inf
        pending = [mem.due for mem in self.members if mem.pending]
        if pending:
            at = max(self.last_report + c["node_report_s"], min(pending))
        for mem in self.members:
            at = min(at, mem.next_turn_end(), mem.checkpoint + c["checkpoint_s"])
            if not mem.heartbeats:
                quiet = max(self.last_report, mem.last["heartbeat"], self.last_poll) + c["lease_s"] / 2
                at = min(at, quiet, mem.next_snapshot_due())
        return at

    def flush_all(self):
        """Syncs until nothing forced is left: each takes every member's pending reports (one
        segment per sample: a turn's observation goes in the next) and its first owed heartbeat."""
        while True:
            self.urgent = False
            items, sent = [], []
            for mem in self.members:
                batch, later, seen = [], [], set()
                for r in mem.pending:
                    (later if r["sample_id"] in seen else batch).append(r)
                    seen.add(r["sample_id"])
                mem.pending = later
                mem.due = time.monotonic() if later else math.inf
                beat = mem.heartbeats.pop(0) if mem.heartbeats else None
                # a snapshot rides the flush once 80% due, as a checkpoint does: no heartbeat of its own later
                rides = time.monotonic() - mem.last["snapshot"] >= CFG["heartbeat_s"] * 0.8
                # an owed snapshot, or progress unsent for 80% of snapshot_every_s, rides as a heartbeat
                stale = bool(mem.held) and time.monotonic() - mem.last["snapshot"] >= CFG["snapshot_every_s"] * 0.8
                if not batch and beat is None and (mem.owed or stale) and rides:
                    beat = m.HeartbeatIn(version=mem.version, snapshot=mem.snapshot(), lease_seconds=CFG["lease_s"])
                if not batch and beat is None:
                    continue
                snap = mem.snapshot() if batch and not later and rides else None
                item = m.NodeItemIn(
                    instance_id=mem.instance,
                    reports=[report_in(r) for r in batch],
                    snapshot=snap,
                    heartbeat=beat,
                )
                items.append(item)
                sent.append((mem, batch, snap, beat))
            if not items:
                return
            out = self.call("sync (flush)", "/instances/sync", m.NodeSyncIn(items=items), m.NodeSyncOut, key=True)
            now = time.monotonic()
            self.last_report = now
            for k, (mem, batch, snap, beat) in enumerate(sent):
                ok = out is not None and out.results[k].status == 200
                if out is not None and not ok:
                    SHARED["lapses"] += 1  # an instance's item refused: its lease lapsed (or a route lost)
                if ok:
                    SHARED["finished"] += sum(r["kind"] == "finished" for r in batch)
                    SHARED["tokens"] += sum(len(r["tokens"]) for r in batch)
                if batch:
                    mem.last["report"] = now
                if snap is not None or beat is not None:
                    mem.last["snapshot"], mem.owed = now, False
                elif batch:
                    mem.owed = True
                if beat is not None:
                    mem.last["heartbeat"] = now
            if not self.urgent and not any(mem.heartbeats for mem in self.members):
                return

    def poll_loop(self):
        by_id = {mem.instance: mem for mem in self.members}
        body = m.NodeSyncIn(poll=list(by_id))
        while True:
            self.last_poll = time.monotonic()
            out = self.call(
                "sync (long-poll)",
                "/instances/sync",
                body,
                m.NodeSyncOut,
                params=f"?wait={CFG['poll_wait_s']}&limit=1000",
                key=True,
            )
            if out is None:
                gevent.sleep(0.1)
                continue
            at = time.time()
            for d in out.deliveries:
                if d.status != 200:
                    SHARED["lapses"] += 1
                    continue
                if d.work or d.commands:
                    for cmd in d.commands:
                        if cmd.kind == "pull" and cmd.target_version is not None:
                            SHARED["deliveries"].append((cmd.target_version, d.instance_id, at))
                    self.inbox.append((by_id[d.instance_id], m.PollOut(work=d.work, commands=d.commands)))
                    self.wake.set()
            if any(d.status != 200 for d in out.deliveries):
                gevent.sleep(1.0)  # fenced: this bench counts it as a lapse (no re-registration)


class Coordinator(Api):
    role = "coordinator"
    fixed_count = 1

    def on_start(self):
        self.mirror = SnapshotMirror()

    @task
    def cycle(self):
        c = CFG
        # what changed since the last read, merged into the mirror (whole on the first read)
        since = "" if self.mirror.position is None else f"?since={self.mirror.position}"
        doc = self.call("snapshot_changes", "/snapshot/changes", None, None, params=since, method="GET", raw=True)
        if doc is None:
            gevent.sleep(0.2)
            return
        mirror = self.mirror
        mirror.apply(doc)
        # read per instance from the mirror, as the live coordinator does (InstanceRows), not
        # through `view`, which sorts every running sample of the run each cycle
        version = mirror.run["version"] if mirror.run else 0
        instances = [mirror.instances[i] for i, _ in mirror.live if i in mirror.instances]
        queued = mirror.queued_rows()
        if version > SHARED["pulled"]:  # a new version: every instance behind it pulls
            SHARED["pulled"] = version
            ids = [i[0] for i in instances if i[2] < version]
            for k in range(0, len(ids), 1000):
                SHARED["pulls"][version] = time.time()
                body = m.PullIn(instance_ids=ids[k : k + 1000], target_version=version)
                self.call("pull", "/commands/pull", body, m.CommandsOut, key=True)
        if len(queued) < c["slots"] * max(1, len(instances)) // 4:
            # random ids (slices of the pool): a prompt of one repeated id compressed ~10x in
            # every stored delivery and prompt row, which real prompts do not
            n = c["prompt_tokens"]
            prompts = [
                m.PromptIn(client_key=uuid.uuid4().hex, prompt_tokens=TOKEN_POOL[o : o + n])
                for o in (random.randrange(len(TOKEN_POOL) - n) for _ in range(c["enqueue_groups"]))
            ]
            for k in range(0, len(prompts), c["enqueue_chunk"]):  # a data loader's chunks
                self.call("enqueue", "/prompts", m.EnqueueIn(prompts=prompts[k : k + c["enqueue_chunk"]]), m.EnqueueOut)
        free = {
            i[0]: c["slots"] - len(mirror.by_instance.get(i[0], ()))
            for i in instances
            if i[2] == version and not (i[3] or {}).get("pulling")
        }
        pairs = []
        slots = [iid for iid, n in free.items() for _ in range(max(0, n))]
        random.shuffle(slots)
        for q, iid in zip(queued, slots, strict=False):
            pairs.append({"sample_id": q[0], "instance_id": iid})
        for k in range(0, len(pairs), 2000):
            body = m.RouteIn.model_validate({"routes": pairs[k : k + 2000]})
            self.call("route", "/routes", body, m.RouteOut, key=True)
        gevent.sleep(c["coordinator_s"])


class Rewarder(Api):
    role = "reward"
    fixed_count = 0  # set from the config

    @task
    def score(self):
        limit = 256
        body = m.ClaimIn(limit=limit, claim_seconds=60.0)
        got = self.call(
            "claim (long-poll)", "/rewards/claim", body, m.ClaimOut, params="?wait=1.0" + packed_query(), key=True
        )
        claimed_at = time.monotonic()
        if got and got.tasks:
            rewards = [
                m.RewardIn(sample_id=t.sample_id, reward_attempt=t.reward_attempt, reward=t.sample_id % 2)
                for t in got.tasks
            ]
            self.call("reward", "/rewards", m.RewardsIn(rewards=rewards), m.RewardsOut, key=True)
            if len(got.tasks) < limit:  # the reward worker's linger after a partial claim
                gevent.sleep(max(0.0, claimed_at + CFG["claim_linger_s"] - time.monotonic()))


class Trainer(Api):
    role = "trainer"
    fixed_count = 1

    @task
    def train(self):
        v = SHARED["version"]
        got = self.call(
            "consume (long-poll)", f"/batches/{v}/consume", None, m.ConsumeOut, params="?wait=2.0" + packed_query()
        )
        if got is not None and got.batch is not None:
            gevent.sleep(CFG["train_s"])
            out = self.call(
                "publish", f"/batches/{v}/publish", m.PublishIn(consume_fence=got.batch.consume_fence), m.PublishOut
            )
            if out is not None:
                SHARED["version"] = max(SHARED["version"], out.version)


def main() -> None:
    cfg_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    CFG.update(json.loads(cfg_path.read_text()))
    per_node = CFG.get("per_node", 1)
    classes: list[type[Api]] = [Instance] if per_node == 1 else [Node]
    control = 0
    if CFG["control"]:
        Rewarder.fixed_count = CFG["rewarders"]
        classes += [Coordinator, Trainer, Rewarder]
        control = 2 + CFG["rewarders"]
    env = Environment(user_classes=classes)

    def crashed(user_instance, exception, tb):  # a user's code raised: an error of the step
        SHARED["crashes"] += 1
        if len(SHARED["errors"]) < 10:
            SHARED["errors"].append(f"{type(user_instance).__name__} raised {exception!r}")

    env.events.user_error.add_listener(crashed)
    runner = env.create_local_runner()
    # The generator's CPU is taken from the server it measures (the same cores): collect less
    # often (its calls' objects die young), and never again what it holds at start.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    users = CFG["instances"] // per_node + control
    runner.start(users, spawn_rate=max(1.0, users / max(1.0, CFG["spawn_s"])))
    gevent.sleep(max(0.0, CFG["start_at"] - time.time()))
    env.stats.reset_all()
    SHARED.update(deliveries=[], lapses=0, finished=0, tokens=0, crashes=0)
    started = time.time()
    unsent_from = unsent(time.monotonic())
    gevent.sleep(max(0.0, CFG["end_at"] - time.time()))
    seconds = time.time() - started
    generated = SHARED["tokens"] + unsent(time.monotonic()) - unsent_from
    stats = {
        name: {
            "calls": e.num_requests,
            "failures": e.num_failures,
            "ms": {str(k): v for k, v in e.response_times.items()},
        }
        for (name, _method), e in env.stats.entries.items()
    }
    pulls = {str(k): v for k, v in SHARED["pulls"].items()}
    out = dict(
        stats=stats,
        seconds=seconds,
        pulls=pulls,
        deliveries=SHARED["deliveries"],
        lapses=SHARED["lapses"],
        finished=SHARED["finished"],
        tokens=SHARED["tokens"],
        generated=generated,
        crashes=SHARED["crashes"],
        errors=SHARED["errors"],
        users=runner.user_count,
    )
    out_path.write_text(json.dumps(out))
    runner.quit()


if __name__ == "__main__":
    main()
