"""Backend kills: protocol operations from several processes while another process kills their
PostgreSQL backends at random moments (idle, mid-transaction, at commit), then a check that
the database agrees with what every caller was told.

Each worker journals every call: `acked` (it returned), `refused` (a ProtocolError: nothing
changed) or `unknown` (the connection died: the commit may or may not have happened). Writes
that can be retried carry a request id and are retried with the same id until the outcome is
known; an instance whose reports stay unknown is abandoned, as a crashed process would be
(its lease expires and its samples go back to the queue).

    python bench/backend_kills.py [--seconds 120] [--ops 0] [--workers 3]

The test `tests/test_backend_kills.py` runs the CI-sized configuration. Last line:
`backend_kills kills=K ops=N unknown=U problems=P violations=V`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script, bench/ would come first on sys.path and bench/api.py shadow the `api` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

import psycopg
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from staleflow_db.db import make_engine
from staleflow_db.enums import SegmentKind
from staleflow_db.errors import Conflict, ProtocolError
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RouteOutcome, RunConfig

SPAWN = mp.get_context("spawn")
APP = "sf-chaos"  # application_name prefix of the workers' connections: the killer's target
CONFIG = dict(
    batch_size=4,
    buffer_capacity=5,
    group_size=2,
    samples_per_group=3,
    eta=2,
    dapo_filter=True,
    max_response_tokens=40,
    max_prompt_tokens=8,
)
INSTANCE_LEASE_S = 2.0
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
    body = {"rollout": _rollout, "reward": _reward, "trainer": _trainer, "meddler": _meddler}[kind]
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
            work, _ = j.call("poll", lambda: p.poll_work(inst), instance=inst)
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
            lease=w.lease,
        )
        try:
            j.retried(
                "report",
                lambda rid: p.report(run, [r], request_id=rid),
                items=[[w.sample_id, w.attempt, toks]],
                kind=kind.value,
            )
        except ProtocolError:
            return True  # the lease is gone (aborted, interrupted, expired): drop the sample
        except Unknown:
            return False
        pos, left = pos + n, left - n
    return True


def _reward(p: Protocol, reader, run: int, name: str, done, rng: random.Random, j: Journal, extra) -> None:
    while not done():
        tasks = _attempt(j, "claim", lambda: p.claim_rewards(run, limit=8, lease_seconds=3.0))
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
                break  # the claim lease runs out and another claim scores them


def _trainer(p: Protocol, reader, run: int, name: str, done, rng: random.Random, j: Journal, extra) -> None:
    v = _scalar(reader, "SELECT version FROM runs WHERE id = :r", r=run)
    while not done():
        _attempt(j, "expire", lambda: p.expire_instances(run))
        _attempt(j, "abort_after_ready", lambda: p.abort_after_ready(run))
        batch = _attempt(j, "consume", lambda: p.consume(run, v), version=v)
        if batch is None:
            time.sleep(0.03)
            continue
        j.calls[-1]["lease"] = batch.lease
        for _try in range(RETRIES):
            checksum = f"{name}-v{v}-{uuid.uuid4().hex[:8]}"  # unique per call: tells whose publish landed
            try:
                new = j.call(
                    "publish",
                    lambda: p.publish(run, v, batch.lease, 1, checksum, "bench"),
                    version=v,
                    checksum=checksum,
                    lease=batch.lease,
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


# ---- the whole drive and its check ------------------------------------------------------------


def setup_run(engine, prompts: int) -> int:
    p = Protocol(engine)
    run = p.create_run(f"backend-kills-{uuid.uuid4().hex[:6]}", RunConfig(**CONFIG))
    p.enqueue(run, [Prompt(f"q{i}", [1 + i % 7, 2, 3]) for i in range(prompts)])
    return run


def drive(url: str, run: int, out_dir: Path, seconds: float, rollouts: int = 3, ops: int = 0) -> dict[str, Any]:
    """Run the workers and the killer; returns the journals by worker name (plus `killer`)."""
    roles = [("rollout", f"rollout-{i}") for i in range(rollouts)]
    roles += [("reward", "reward-0"), ("trainer", "trainer"), ("meddler", "meddler")]
    procs = [
        SPAWN.Process(target=worker_main, args=(kind, url, run, name, str(out_dir), seconds, ops, seed))
        for seed, (kind, name) in enumerate(roles)
    ]
    procs.append(SPAWN.Process(target=killer_main, args=(url, str(out_dir), seconds, 99)))
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(seconds + 60)
        if proc.is_alive():
            proc.kill()
    return {f.stem: json.loads(f.read_text()) for f in out_dir.glob("*.json")}


def _rows(engine, sql: str, **params):
    with engine.connect() as c:
        return c.execute(text(sql), params).all()


def check(engine, run: int, logs: dict[str, Any]) -> dict[str, Any]:
    """Every acked outcome in the database, every refused one absent, unknown ones all-or-nothing;
    segments never duplicated; the audit view empty. Returns figures and a list of problems."""
    problems: list[str] = []
    calls = [c for name, log in logs.items() if name != "killer" for c in log["calls"]]
    problems += [f"{n}: crashed\n{log['crash']}" for n, log in logs.items() if log.get("crash")]
    problems += [
        f"{c['worker']} {c['op']}: unexpected database error {c['error']}\n{c.get('traceback', '')}"
        for c in calls
        if c.get("outcome") == "failed"
    ]
    problems += [
        f"sample {c['sample']}: delivered prefix differs from the reported tokens"
        for c in calls
        if c.get("outcome") == "mismatch"
    ]
    segs = defaultdict(list)
    for sid, _seq, att, toks in _rows(
        engine,
        "SELECT sample_id, seq, attempt, token_ids FROM segments WHERE run_id = :r ORDER BY sample_id, seq",
        r=run,
    ):
        segs[sid].append((att, tuple(toks)))
    have = lambda sid, att, toks: (att, tuple(toks)) in segs.get(sid, [])  # noqa: E731

    def present(c: dict) -> list[bool]:
        return [have(*i) for i in c["items"] if i[2]]

    rewards = {
        sid: (att, r)
        for sid, att, r in _rows(engine, "SELECT id, reward_attempt, reward FROM samples WHERE run_id = :r", r=run)
    }
    stored = lambda sid, att, val: rewards.get(sid) == (att, val)  # noqa: E731
    acked_items = {
        (c["op"], *map(_key, i)) for c in calls if c.get("outcome") == "acked" and "items" in c for i in c["items"]
    }
    unknown_rids = {c["request_id"] for c in calls if c.get("outcome") == "unknown" and "request_id" in c}
    for c in calls:
        op, outcome = c["op"], c.get("outcome")
        if op == "report":
            got = present(c)
            if outcome == "acked" and not all(got):
                problems.append(f"acked report missing: {c['items']} ({c['worker']} #{c['n']})")
            if outcome == "refused" and any(got) and (op, *map(_key, c["items"][0])) not in acked_items:
                problems.append(_refused_applied(c, unknown_rids))
        elif op == "reward":
            got = [stored(*i) for i in c["items"]]
            if outcome == "acked" and not all(got):
                problems.append(f"acked rewards missing: {[i for i, g in zip(c['items'], got) if not g]}")
            if (
                outcome == "unknown"
                and len(set(got)) > 1
                and not any((op, *map(_key, i)) in acked_items for i in c["items"])
            ):
                problems.append(f"reward call half applied: {c['items']}")
            if outcome == "refused":
                lost = set(c.get("lost", []))
                if any(i[0] in lost and stored(*i) for i in c["items"]):
                    problems.append(_refused_applied(c, unknown_rids))
    published = dict(_rows(engine, "SELECT version, checksum FROM param_versions WHERE run_id = :r", r=run))
    ours = defaultdict(set)  # version -> checksums of the calls that may have published it
    for c in calls:
        if c["op"] == "publish" and c.get("outcome") in ("acked", "unknown"):
            ours[c["version"] + 1].add(c["checksum"])
    for c in calls:
        if c["op"] != "publish":
            continue
        v1 = c["version"] + 1
        if c.get("outcome") == "acked" and published.get(v1) not in ours[v1]:
            problems.append(f"acked publish of v{v1} missing or foreign: {published.get(v1)!r}")
        if c.get("outcome") == "refused" and published.get(v1) == c["checksum"]:
            problems.append(f"refused publish of v{v1} applied")
    states = dict(_rows(engine, "SELECT id, state::text FROM samples WHERE run_id = :r", r=run))
    groups = dict(_rows(engine, "SELECT id, state::text FROM prompt_groups WHERE run_id = :r", r=run))
    problems += [
        f"acked abort of group {c['aborted_group']} not applied ({groups.get(c['aborted_group'])})"
        for c in calls
        if c.get("aborted_group") and groups.get(c["aborted_group"]) != "aborted"
    ]
    for c in calls:
        if c["op"] == "abort" and c.get("outcome") == "acked":
            problems += [
                f"acked abort of sample {s} not applied ({states.get(s)})"
                for s in c["aborted"]
                if states.get(s) != "aborted"
            ]
        if c["op"] == "route" and c.get("outcome") == "acked":
            attempts = dict(
                _rows(
                    engine,
                    "SELECT id, attempt FROM samples WHERE id = ANY(:ids)",
                    ids=[s for s, _ in c["routed"]] or [0],
                )
            )
            problems += [
                f"acked route of sample {s} attempt {a} not stored" for s, a in c["routed"] if attempts.get(s, 0) < a
            ]
    for sid, parts in segs.items():
        toks = [t for _, seg in parts for t in seg]
        if toks != expected(sid, len(toks)):
            problems.append(
                f"sample {sid}: tokens are not the concatenation of one generation "
                f"(duplicated or lost segment): {[len(s) for _, s in parts]}"
            )
    n_tok = dict(_rows(engine, "SELECT id, n_tokens FROM samples WHERE run_id = :r", r=run))
    problems += [
        f"sample {s}: n_tokens {n_tok[s]} != segments {sum(len(x) for _, x in segs.get(s, []))}"
        for s in n_tok
        if n_tok[s] != sum(len(x) for _, x in segs.get(s, []))
    ]
    version = _rows(engine, "SELECT version FROM runs WHERE id = :r", r=run)[0][0]
    if sorted(published) != list(range(1, version + 1)):
        problems.append(f"published versions {sorted(published)} not contiguous up to {version}")
    violations = _rows(engine, "SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :r", r=run)
    problems += [f"violation {v}" for v in violations]
    outcomes = defaultdict(int)
    for c in calls:
        outcomes[c.get("outcome", "?")] += 1
    kills = logs.get("killer", {}).get("kills", {})
    return {
        "version": version,
        "kills": kills,
        "outcomes": dict(outcomes),
        "calls": len(calls),
        "violations": len(violations),
        "problems": problems,
    }


def _refused_applied(c: dict, unknown_rids: set[str]) -> str:
    where = f"{c['worker']} #{c['n']}: {c['items']} ({c.get('error')})"
    if c.get("request_id") in unknown_rids:  # the first try committed; the retry must replay it
        return f"idempotency: a retried {c['op']} (same request id) was refused, not replayed: {where}"
    return f"refused {c['op']} was applied: {where}"


def _key(x: Any) -> Any:
    return tuple(x) if isinstance(x, list) else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--ops", type=int, default=0, help="stop each worker after this many calls (0: no limit)")
    ap.add_argument("--workers", type=int, default=3, help="rollout worker processes")
    ap.add_argument("--prompts", type=int, default=0, help="default: enough for the run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from bench.harness import private_postgres

    out = args.out or Path("reports") / f"backend-kills-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    with private_postgres(out / "home") as url:
        engine = make_engine(url)
        run = setup_run(engine, args.prompts or int(40 + args.seconds * 4))
        logs = drive(url, run, out, args.seconds, args.workers, args.ops)
        result = check(engine, run, logs)
        engine.dispose()
    (out / "result.json").write_text(json.dumps(result, indent=2))
    for pr in result["problems"][:50]:
        print("PROBLEM", pr)
    print(f"versions {result['version']}, calls {result['calls']} {result['outcomes']}, kills {result['kills']}")
    print(
        f"backend_kills kills={sum(result['kills'].values())} ops={result['calls']} "
        f"unknown={result['outcomes'].get('unknown', 0)} problems={len(result['problems'])} "
        f"violations={result['violations']}"
    )


if __name__ == "__main__":
    sys.exit(main())
