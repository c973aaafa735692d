"""A scene for the node-sync kill tests: one run on a real API process, a node of instances
(one routed sample each) driven by the workers' own client, row locks of the test's own that
stop the node's transaction at a chosen statement, the database backend serving it found and
terminated, and what the database holds before and after.

The client is `StaleFlowClient` as workers/rollout/node.py uses it (its `sync`), over an
httpx client that records every answer: which request id each attempt carried and what
status came back, so a test sees the 503 and the retry under the same Idempotency-Key."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
from sqlalchemy import text

from staleflow_db.db import make_engine
from staleflow_db.payloads import pack_logprobs, pack_tokens
from tests.api_helpers import ApiServer, token
from workers.client import StaleFlowClient
from workers.wire import models as m

LEASE = 60.0
HOLDER = "sf-test-holder"  # application_name of the test's own lock holders
WRITES = "RowExclusiveLock"  # a table lock every INSERT, UPDATE and DELETE takes


class Recorded:
    """The workers' client; `seen` gets (path, Idempotency-Key, status) for every answer."""

    def __init__(self, url: str, token_: str):
        self.seen: list[tuple[str, str | None, int]] = []
        http = httpx.Client(base_url=url, timeout=60.0, event_hooks={"response": [self._saw]})
        # short waits between attempts; it retries for as long as a test may take
        self.client = StaleFlowClient(url, token_, http=http, backoff=0.05, max_backoff=0.2, retry_for=120.0)

    def _saw(self, r: httpx.Response) -> None:
        self.seen.append((r.request.url.path, r.request.headers.get("Idempotency-Key"), r.status_code))

    def syncs(self) -> list[tuple[str | None, int]]:
        return [(k, s) for p, k, s in self.seen if p.endswith("/instances/sync")]


class Call:
    """A client call in a thread of its own: `result()` waits for its value or raises its error."""

    def __init__(self, fn: Callable[[], Any]):
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._out["value"] = fn()
        except BaseException as e:  # raised again in the test's thread
            self._out["error"] = e

    def result(self, timeout: float = 120.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not return"
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


class Held:
    """A transaction of the test's own holding what `statements` lock or write, until `release`."""

    def __init__(self, db_url: str, statements: Sequence[tuple[str, Sequence[Any]]]):
        self.conn = psycopg.connect(db_url, application_name=HOLDER)
        self.pid = self.conn.info.backend_pid
        for sql, params in statements:
            self.conn.execute(sql, params)

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


def sample_lock(db_url: str, sample_id: int) -> Held:
    return Held(db_url, [("SELECT id FROM samples WHERE id = %s FOR UPDATE", (sample_id,))])


def segment_slot(db_url: str, run: int, sample_id: int, instance_id: int, attempt: int) -> Held:
    """A first segment of the sample, not committed: a report's own first segment waits on it
    (the primary key), after its sample's lock. Inserted with the foreign keys unchecked
    (replica role), so the sample row itself stays unlocked."""
    return Held(
        db_url,
        [
            ("SET LOCAL session_replication_role = replica", ()),
            (
                "INSERT INTO segments (sample_id, seq, run_id, version, instance_id, attempt, token_ids, logprobs,"
                " n_tokens, generated) VALUES (%s, 0, %s, 0, %s, %s, %s, %s, 1, true)",
                (sample_id, run, instance_id, attempt, pack_tokens([9]), pack_logprobs([-0.5])),
            ),
        ],
    )


@dataclass
class Backend:
    pid: int
    wrote: bool  # its transaction has an xid: something written
    blocked_by: list[int]
    wait_event: str | None
    query: str


def api_backends(db_url: str) -> list[Backend]:
    """The API's database backends that are running a statement now."""
    with psycopg.connect(db_url, autocommit=True) as c:
        rows = c.execute(
            "SELECT pid, backend_xid IS NOT NULL, pg_blocking_pids(pid), wait_event, query FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'staleflow' AND state = 'active'"
        ).fetchall()
    return [Backend(*r) for r in rows]


def locks_held(db_url: str, pid: int) -> set[tuple[str, str]]:
    """(table, mode) of the granted table locks of backend `pid`."""
    with psycopg.connect(db_url, autocommit=True) as c:
        rows = c.execute(
            "SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
            " WHERE l.pid = %s AND l.granted AND l.locktype = 'relation'",
            (pid,),
        ).fetchall()
    return {(r[0], r[1]) for r in rows}


def terminate(db_url: str, pid: int) -> None:
    """Kill backend `pid` and wait until it is gone. pg_terminate_backend only signals: a backend
    released from its wait (for the standby when commits_held is left, for a lock when its
    holder lets go) before it handles the signal goes on, commits and tells its client."""
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)

        def gone() -> bool:
            return not c.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()

        wait_for(gone, f"backend {pid} to exit")


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def blocked_by(db_url: str, holder: int, *, other_than: Sequence[int] = ()) -> Backend:
    """The API backend waiting on a lock `holder` holds (not one of `other_than`)."""

    def find() -> Backend | None:
        got = [b for b in api_backends(db_url) if holder in b.blocked_by and b.pid not in other_than]
        return got[0] if got else None

    found: Backend = wait_for(find, f"an API backend blocked by {holder}")
    return found


@contextmanager
def commits_held(url: str) -> Iterator[None]:
    """While inside: every durable commit on the server behind `url` (its own server: this is
    server-wide) is written and flushed locally, then waits for a synchronous standby that
    never comes (wait event SyncRep). A backend terminated there has committed; its client is
    never told. Needs synchronous_commit on and max_wal_senders > 0."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("ALTER SYSTEM SET synchronous_standby_names = 'staleflow_never'")
        c.execute("SELECT pg_reload_conf()")
        try:
            # the setting takes effect when the checkpointer has read it: a probe commit waits
            wait_for(lambda: _probe_waits(url), "synchronous commits to wait")
            yield
        finally:
            c.execute("ALTER SYSTEM RESET synchronous_standby_names")
            c.execute("SELECT pg_reload_conf()")


def _probe_waits(url: str) -> bool:
    """Whether a commit now waits for the standby (the probe is then cancelled: committed)."""
    done = threading.Event()
    with psycopg.connect(url, application_name=HOLDER) as probe:
        pid = probe.info.backend_pid
        probe.execute("CREATE TEMP TABLE staleflow_probe ON COMMIT DROP AS SELECT 1")  # WAL to commit

        def commit() -> None:
            probe.commit()
            done.set()

        t = threading.Thread(target=commit, daemon=True)
        t.start()
        with psycopg.connect(url, autocommit=True) as c:
            for _ in range(50):
                if done.is_set():
                    break
                ev = c.execute("SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
                if ev and ev[0] == "SyncRep":
                    c.execute("SELECT pg_cancel_backend(%s)", (pid,))  # the wait ends; the commit stands
                    t.join(10)
                    return True
                time.sleep(0.02)
        t.join(10)
    return False


def in_sync_rep(db_url: str) -> Backend | None:
    """The API backend committing a write to instances, samples or segments (a node's sync or
    poll), waiting for the standby; one at most. Others may wait there too (a NOTIFY's)."""
    node_tables = {("instances", WRITES), ("samples", WRITES), ("segments", WRITES)}
    got = [b for b in api_backends(db_url) if b.wait_event == "SyncRep" and locks_held(db_url, b.pid) & node_tables]
    assert len(got) <= 1, got
    return got[0] if got else None


@dataclass
class Scene:
    """A run and a node of instances by name, each with one sample routed to it."""

    server: ApiServer
    db_url: str
    run: int
    token: str
    admin: StaleFlowClient
    iids: dict[str, int] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    works: dict[str, m.WorkOut] = field(default_factory=dict)

    def recorded(self) -> Recorded:
        return Recorded(self.server.url, self.token)

    def item(self, name: str, n: int = 2, heartbeat: bool = False) -> dict[str, Any]:
        """`name`'s item: a partial segment of `n` tokens with a snapshot (its instance's row
        written), and a heartbeat when asked."""
        w = self.works[name]
        report = {
            "sample_id": w.sample_id,
            "attempt": w.attempt,
            "route_token": w.route_token,
            "version": 0,
            "tokens": [5 + k for k in range(n)],
            "logprobs": [-0.5] * n,
            "kind": "partial",
        }
        item: dict[str, Any] = {"instance_id": self.iids[name], "reports": [report], "snapshot": {"running": 1}}
        if heartbeat:
            item["heartbeat"] = {"version": 0, "snapshot": {"running": 1, "waiting": 2}, "lease_seconds": LEASE}
        return item

    def sql(self, query: str, **params: Any) -> list[Any]:
        engine = make_engine(self.db_url, connect_args={"application_name": HOLDER})  # not the API's
        try:
            with engine.begin() as c:
                res = c.execute(text(query), params)
                return list(res.all()) if res.returns_rows else []
        finally:
            engine.dispose()

    def lapse(self, name: str) -> None:
        self.sql("UPDATE instances SET lease_expires_at = now() - interval '1 second' WHERE id = :i", i=self.iids[name])

    def lease_left(self, name: str, seconds: float) -> None:
        self.sql(
            "UPDATE instances SET lease_expires_at = now() + make_interval(secs => :s) WHERE id = :i",
            i=self.iids[name],
            s=seconds,
        )

    def state(self) -> dict[str, Any]:
        """By instance name: its row (lease, snapshot) and its sample (state, tokens, segments,
        delivered); the node's stored outcomes; the run's audit violations."""
        names = {v: k for k, v in self.iids.items()}
        inst = {
            names[r[0]]: tuple(r[1:])
            for r in self.sql(
                "SELECT id, state::text, lease_expires_at, snapshot::text, snapshot_at, version FROM instances"
                " WHERE run_id = :r",
                r=self.run,
            )
        }
        by_sample = {v: k for k, v in self.samples.items()}
        samples = {
            by_sample[r[0]]: tuple(r[1:])
            for r in self.sql(
                "SELECT s.id, s.state::text, s.attempt, s.n_tokens, s.n_segments, s.delivered,"
                " (SELECT count(*) FROM segments g WHERE g.sample_id = s.id) FROM samples s WHERE s.run_id = :r",
                r=self.run,
            )
        }
        stored = self.sql("SELECT count(*) FROM idempotency WHERE request_id LIKE :k", k=f"%run{self.run}:tok%:node:%")[
            0
        ][0]
        violations = self.sql(
            "SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :r", r=self.run
        )
        return {"instances": inst, "samples": samples, "stored": stored, "violations": violations}


def scene(server: ApiServer, db_url: str, names: Sequence[str], routed: Sequence[str], deliver: bool = True) -> Scene:
    """Instances `names`, registered in that order (ids ascending), and one sample each, routed
    in the order `routed` (sample ids ascending: the last name holds the highest); delivered
    (one node poll) when `deliver`."""
    admin = server.client(token(db_url, "admin"))
    run = admin.create_run(
        f"node-kills-{uuid.uuid4().hex[:8]}", batch_size=len(names), group_size=1, eta=0, max_response_tokens=100
    ).id
    admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(len(names))])
    tok = token(db_url, "rollout", run)
    sc = Scene(server, db_url, run, tok, admin)
    rollout = server.client(tok)
    for n in names:
        sc.iids[n] = rollout.register(run, n, 0, lease_seconds=LEASE).instance_id
    queued = sorted(q.sample_id for q in admin.snapshot(run).queued)
    assert len(queued) == len(names)
    sc.samples = dict(zip(routed, queued, strict=True))
    results = admin.route(run, [(sc.samples[n], sc.iids[n]) for n in routed])
    assert all(r.outcome == "routed" for r in results), results
    if deliver:
        out = rollout.sync(run, poll=[sc.iids[n] for n in names], wait=0)
        by_id = {d.instance_id: d for d in out.deliveries}
        for n in names:
            (sc.works[n],) = by_id[sc.iids[n]].work
    return sc
