"""A scene for the group-commit tests: one run with live and lapsed instances, routed samples,
finished and claimed samples, and a burst of heartbeats, segment reports and rewards (valid,
fenced and bad ones) posted at once over real HTTP, each caller's status and body kept."""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
from sqlalchemy import text

from api.auth import create_token
from tests.protocol_helpers import Driver

TABLES = ("runs", "instances", "prompt_groups", "samples")
LARGE = re.compile(r"(?<![\d.])(\d{5,})(?![\d.])")


@dataclass
class Call:
    name: str
    path: str
    body: dict[str, Any]
    key: str | None = None
    reaches_group: bool = True  # False: refused by request validation before any write


@dataclass
class Scene:
    d: Driver
    base: str
    headers: dict[str, dict[str, str]]
    symbols: dict[int, str] = field(default_factory=dict)
    instances: dict[str, int] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)

    def post(self, call: Call, timeout: float = 60.0) -> tuple[int, Any]:
        role = "reward" if "/rewards" in call.path else "rollout"
        headers = dict(self.headers[role])
        if call.key is not None:
            headers["Idempotency-Key"] = call.key
        r = httpx.post(self.base + call.path, json=call.body, headers=headers, timeout=timeout)
        return r.status_code, r.json()

    def normalised(self, body: Any) -> str:
        """`body` as JSON with this scene's ids replaced by their names (another scene's
        outcomes compare equal when they differ only by ids)."""
        return LARGE.sub(lambda m: self.symbols.get(int(m.group(1)), m.group(1)), httpx.Response(200, json=body).text)

    def register(self, name: str, lease_seconds: float = 600.0) -> int:
        status, body = self.post(Call(name, "/instances", {"name": name, "version": 0, "lease_seconds": lease_seconds}))
        assert status == 201, body
        self.instances[name] = body["instance_id"]
        self.symbols[body["instance_id"]] = name
        return int(body["instance_id"])

    def sample(self, name: str) -> int:
        (g,) = self.d.enqueue(1)
        (s,) = self.d.members(g)
        self.samples[name] = s
        self.symbols[s], self.symbols[g] = name, f"group-{name}"
        return int(s)

    def route(self, sample: str, instance: str) -> dict[str, Any]:
        """A new sample named `sample` routed to `instance`: its reporting identity."""
        s = self.sample(sample)
        attempt = self.d.routed([s], self.instances[instance])[s]
        self.attempts[sample] = attempt
        token = self.d.route_identity(s)["route_token"]
        return {"sample_id": s, "attempt": attempt, "route_token": str(token)}

    def lapse(self, instance: str) -> None:
        with self.d.engine.begin() as c:
            c.execute(
                text("UPDATE instances SET lease_expires_at = now() - interval '1 second' WHERE id = :i"),
                {"i": self.instances[instance]},
            )

    def path(self, instance: str, what: str) -> str:
        return f"/instances/{self.instances[instance]}/{what}"

    # ---- what the database holds -------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Per sample (by name): state, tokens, segments, reward; per instance: state, snapshot."""
        samples = {
            self.symbols[r[0]]: tuple(r[1:])
            for r in self.d.rows(
                "SELECT s.id, s.state::text, s.n_tokens, (SELECT count(*) FROM segments g WHERE g.sample_id = s.id),"
                " s.reward FROM samples s WHERE s.run_id = :r"
            )
        }
        instances = {
            self.symbols[r[0]]: (r[1], r[2])
            for r in self.d.rows("SELECT id, state::text, snapshot::text FROM instances WHERE run_id = :r")
        }
        return {"samples": samples, "instances": instances}

    def leases(self) -> dict[str, Any]:
        return {
            self.symbols[r[0]]: r[1]
            for r in self.d.rows("SELECT id, lease_expires_at FROM instances WHERE run_id = :r")
        }


def bump_ids(engine: Any, base: int) -> None:
    """Ids of this scene's rows from `base` on: two scenes never share one, and every id is
    large enough to tell from attempts, versions and counts in a body."""
    with engine.begin() as c:
        for i, t in enumerate(TABLES):  # apart per table too: a name per id
            c.execute(text(f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), {base + 1000 * i})"))


def build(engine: Any, base_url: str, name: str, id_base: int) -> tuple[Scene, list[Call]]:
    """The scene and its burst: calls whose outcomes do not depend on their order."""
    bump_ids(engine, id_base)
    d = Driver(engine, name=name, batch_size=8, group_size=1, eta=1)
    headers = {
        role: {"Authorization": f"Bearer {create_token(engine, role, d.run)['token']}"}
        for role in ("rollout", "reward")
    }
    sc = Scene(d, f"{base_url}/v1/runs/{d.run}", headers, symbols={d.run: "run"})
    for i in range(4):
        sc.register(f"A{i}")
    sc.register("L")
    sc.register("P")  # the plug: no work, its heartbeat can be held on a row lock
    routed = {f"s{i}": sc.route(f"s{i}", f"A{i}") for i in range(4)}
    lapsed = sc.route("sL", "L")
    bad_version = sc.route("sV", "A1")
    bad_token = sc.route("sT", "A2")
    pre = sc.route("sP", "A3")
    for w in ("w0", "w1", "w2"):
        sc.sample(w)
        sc.d.finish(sc.d.routed([sc.samples[w]], sc.instances["A0"]))
    claims = {t.sample_id: t.reward_attempt for t in sc.d.p.claim_rewards(sc.d.run, 10)}
    sc.lapse("L")

    def seg(ident: dict[str, Any], kind: str = "finished", version: int = 0, tokens: tuple[int, ...] = (7, 8)):
        return {"reports": [{**ident, "version": version, "tokens": list(tokens), "logprobs": [-0.5] * len(tokens),
                             "kind": kind}]}  # fmt: skip

    # a request id used before the burst: its replay and its reuse for another body
    pre_body = seg(pre, "partial", tokens=(5,))
    status, body = sc.post(Call("pre", sc.path("A3", "segments"), pre_body, "kpre"))
    assert (status, body) == (200, {"applied": 1})

    def reward(w: str, attempt_delta: int = 0) -> dict[str, Any]:
        s = sc.samples[w]
        return {"rewards": [{"sample_id": s, "reward_attempt": claims[s] + attempt_delta, "reward": 1.0}]}

    calls = [Call(f"hb_A{i}", sc.path(f"A{i}", "heartbeat"), {"version": 0, "lease_seconds": 900}) for i in range(4)]
    calls += [
        Call("hb_lapsed", sc.path("L", "heartbeat"), {"version": 0}),
        Call("hb_bad_version", sc.path("A1", "heartbeat"), {"version": 5}),
        *(Call(f"rep_s{i}", sc.path(f"A{i}", "segments"), seg(routed[f"s{i}"]), f"r{i}") for i in range(4)),
        Call("rep_same_key_twice", sc.path("A0", "segments"), seg(routed["s0"]), "r0"),
        Call("rep_lapsed", sc.path("L", "segments"), seg(lapsed)),
        Call("rep_bad_version", sc.path("A1", "segments"), seg(bad_version, version=9)),
        Call("rep_bad_token", sc.path("A2", "segments"), seg({**bad_token, "route_token": str(uuid.uuid4())})),
        Call("rep_replay", sc.path("A3", "segments"), pre_body, "kpre"),
        Call("rep_key_reused", sc.path("A3", "segments"), seg(pre, "partial", tokens=(6,)), "kpre"),
        Call("rw_w0", "/rewards", reward("w0"), "k-w0"),
        Call("rw_w1", "/rewards", reward("w1")),
        Call("rw_stale_claim", "/rewards", reward("w2", 1)),
        Call(
            "rw_unknown_sample", "/rewards", {"rewards": [{"sample_id": 99_999_999, "reward_attempt": 1, "reward": 1}]}
        ),
        Call(
            "rw_not_finite",
            "/rewards",
            {"rewards": [{"sample_id": sc.samples["w2"], "reward_attempt": 1, "reward": "NaN"}]},
            reaches_group=False,
        ),  # fmt: skip
    ]
    return sc, calls


def burst(sc: Scene, calls: list[Call]) -> tuple[list[threading.Thread], dict[str, tuple[int, Any]]]:
    """Post every call at once, each from its own thread; the threads and where each outcome lands."""
    outcomes: dict[str, tuple[int, Any]] = {}
    start = threading.Barrier(len(calls))

    def one(c: Call) -> None:
        start.wait()
        outcomes[c.name] = sc.post(c)

    threads = [threading.Thread(target=one, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    return threads, outcomes


def metric(base_url: str, name: str) -> float:
    text_ = httpx.get(base_url + "/metrics", timeout=30).text
    for line in text_.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class RowLock:
    """A transaction of the test's own holding an instance's row lock: calls that need the row
    wait behind it (the group in flight stays in flight) until `release`."""

    def __init__(self, db_url: str, instance_id: int):
        self.conn = psycopg.connect(db_url)
        self.conn.execute("SELECT 1 FROM instances WHERE id = %s FOR UPDATE", (instance_id,))

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


def api_backends_waiting(db_url: str) -> list[tuple[int, bool]]:
    """The API's backends waiting on a lock now: (pid, whether its transaction wrote already)."""
    with psycopg.connect(db_url, autocommit=True) as c:
        return [
            (r[0], r[1])
            for r in c.execute(
                "SELECT pid, backend_xid IS NOT NULL FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'staleflow' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            ).fetchall()
        ]
