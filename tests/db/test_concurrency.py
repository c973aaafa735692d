"""Concurrency: real OS processes drive one run at once, then the database is audited.

Route workers (one of which "crashes" once, abandoning routes whose instance lease must
expire), reward workers and a trainer run as spawned processes, each with its own engine.
They stop by themselves: the trainer after TARGET_VERSIONS publishes (and once the crashed
instance has expired), everyone at the deadline at the latest. Every worker writes what it
saw (routes received, segments acknowledged, refusals) to a JSON log, so the audit compares
the clients' view with the database's.

Tokens are a pure function of (sample, position), so "every sample's tokens equal the
concatenation of its segments" is checked against what the generator must have produced.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import time
import traceback
from collections import defaultdict
from pathlib import Path

from sqlalchemy import text

from staleflow_db.db import make_engine
from staleflow_db.errors import Conflict
from staleflow_db.payloads import unpack_tokens
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig
from workers.wire.enums import SegmentKind
from workers.wire.types import RouteOutcome

SPAWN = mp.get_context("spawn")
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
PROMPTS = 90
ROUTE_WORKERS, REWARD_WORKERS = 3, 2
TARGET_VERSIONS = 6
DEADLINE_S = 60  # safety net only: a healthy run stops at TARGET_VERSIONS in a few seconds
ROUTE_BATCH = 6
MAX_ATTEMPTS = 3  # interrupts stop after this many routes, so every sample can finish


def tok(sid: int, pos: int) -> int:
    return (sid * 7919 + pos * 31) % 50_000


def logprob(pos: int) -> float:
    return -(pos % 8) / 8  # exact in float4 (real[])


def expected(sid: int, n: int) -> list[int]:
    return [tok(sid, p) for p in range(n)]


def _scalar(engine, sql: str, **params):
    with engine.connect() as c:
        return c.execute(text(sql), params).scalar()


def run_worker(kind: str, url: str, run: int, name: str, log_dir: str, stop, seed: int) -> None:
    """Process entry point; an exception is logged (with its traceback) instead of lost."""
    body = {"route": _route_body, "reward": _reward_body, "trainer": _trainer_body}[kind]
    log: dict = defaultdict(list)
    engine = make_engine(url, pool_size=2, max_overflow=2)
    try:
        body(Protocol(engine), engine, run, name, stop, random.Random(seed), log)
    except BaseException:
        log["error"] = [traceback.format_exc()]
    finally:
        engine.dispose()
        Path(log_dir, f"{name}.json").write_text(json.dumps(log))


def _running(stop, start: float) -> bool:
    return not stop.is_set() and time.monotonic() - start < DEADLINE_S


def _report(p: Protocol, run: int, reports: list[Report], log) -> list[Report]:
    """Report all-or-nothing; routes lost meanwhile (surplus abort, expiry) are dropped and
    the rest retried. Returns the reports applied."""
    while reports:
        try:
            p.report(run, reports)
        except Conflict as e:
            lost = {sid for sid, _ in e.items}
            log["lost"] += [[r.sample_id, r.attempt] for r in reports if r.sample_id in lost]
            reports = [r for r in reports if r.sample_id not in lost]
            continue
        log["segments"] += [[r.sample_id, r.attempt, r.tokens] for r in reports if r.tokens]
        return reports
    return []


def _route_body(p: Protocol, engine, run: int, name: str, stop, rng: random.Random, log) -> None:
    crash_at = 2 if name == "route-0" else None  # this worker crashes once, on its 2nd busy cycle
    lease = 1.0 if crash_at else 10.0
    version = _scalar(engine, "SELECT version FROM runs WHERE id = :r", r=run)
    inst = p.register_instance(run, name, version, lease_seconds=lease)
    zombie: tuple[int, list[Report]] | None = None  # leases of the crashed instance
    busy, start = 0, time.monotonic()
    while _running(stop, start):
        run_version = _scalar(engine, "SELECT version FROM runs WHERE id = :r", r=run)
        try:
            p.heartbeat(inst, run_version, {"worker": name}, lease_seconds=lease)  # pull the latest
            version = run_version
        except Conflict:  # our lease ran out while we were slow: a fresh instance, as on restart
            version = run_version
            inst = p.register_instance(run, name, version, lease_seconds=lease)
            log["reregistered"].append(inst)
        if zombie and _late_report(p, engine, run, zombie, log):
            zombie = None
        with engine.connect() as c:  # members of admitted groups first, as a coordinator would
            candidates = (
                c.execute(
                    text(
                        "SELECT s.id FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
                        " WHERE s.run_id = :r AND s.state = 'queued' AND coalesce(s.last_version, 0) <= :v"
                        " ORDER BY g.state = 'reserved' DESC, random() LIMIT :n"
                    ),
                    {"r": run, "v": version, "n": ROUTE_BATCH},
                )
                .scalars()
                .all()
            )
        if not candidates:
            time.sleep(0.02)
            continue
        results = p.route(run, [(s, inst) for s in candidates])
        routed = {r.sample_id: r.attempt for r in results if r.outcome == RouteOutcome.ROUTED}
        log["route_outcomes"] += [r.outcome.value for r in results]
        if not routed:
            time.sleep(0.02)  # nothing admitted: wait for the trainer rather than spin on the run lock
            continue
        try:
            polled = p.poll_work(inst)
            work, commands = polled.work, polled.commands
        except Conflict:
            continue  # expired between heartbeat and poll; the next cycle registers again
        aborted = {(c.sample_id, c.attempt) for c in commands if c.kind == "abort"}
        log["received"] += [[w.sample_id, w.attempt, inst] for w in work]
        for w in work:  # delivered exactly what was routed to us, with the prefix we generated before
            assert routed.get(w.sample_id) == w.attempt, (w.sample_id, w.attempt, routed)
            assert w.prefix_tokens == expected(w.sample_id, len(w.prefix_tokens)), w.sample_id
            assert w.prefix_logprobs == [logprob(i) for i in range(len(w.prefix_tokens))]
        delivered = {w.sample_id for w in work}
        for sid, att in routed.items():  # routed but not delivered: aborted meanwhile (surplus)
            assert sid in delivered or (sid, att) in aborted, (sid, att)
        if not work:
            continue
        busy += 1
        with engine.connect() as c:  # route only hands out work this instance's version may continue
            floor = dict(
                c.execute(
                    text("SELECT id, greatest(v_traj, coalesce(last_version, 0)) FROM samples WHERE id = ANY(:ids)"),
                    {"ids": [w.sample_id for w in work]},
                ).all()
            )
        assert all(floor[w.sample_id] <= version for w in work), (floor, version)
        partial, final = [], []
        for w in work:
            pos, left = len(w.prefix_tokens), w.max_new_tokens

            def gen(n: int) -> tuple[list[int], list[float]]:
                nonlocal pos, left
                n = min(n, left)
                out = range(pos, pos + n)
                pos, left = pos + n, left - n
                return [tok(w.sample_id, i) for i in out], [logprob(i) for i in out]

            if busy == crash_at or rng.random() < 0.15:  # a checkpoint: the sample keeps running
                partial.append(
                    Report(
                        w.sample_id,
                        w.attempt,
                        version,
                        *gen(rng.randint(1, 4)),
                        SegmentKind.PARTIAL,
                        instance_id=inst,
                        route_token=w.route_token,
                    )
                )
            interrupt = w.attempt < MAX_ATTEMPTS and left > 8 and rng.random() < 0.4
            kind = SegmentKind.INTERRUPTED if interrupt else SegmentKind.FINISHED
            n = rng.randint(0, 5) if interrupt else rng.randint(1, 8)
            final.append(
                Report(
                    w.sample_id,
                    w.attempt,
                    version,
                    *gen(n),
                    kind,
                    None if interrupt else "stop",
                    instance_id=inst,
                    route_token=w.route_token,
                )
            )
        applied = {r.sample_id for r in _report(p, run, partial, log)}
        if busy == crash_at and not applied:
            crash_at += 1  # every checkpoint lost its route meanwhile: crash next time instead
        elif busy == crash_at:
            # Crash: the instance stops heartbeating with its leases (and checkpoints) in the
            # database; the restarted process registers a new instance. The trainer's
            # expire_instances must requeue the samples with the tokens reported so far.
            dead = [
                Report(
                    r.sample_id,
                    r.attempt,
                    version,
                    [tok(r.sample_id, 99)],
                    [0.0],
                    SegmentKind.FINISHED,
                    instance_id=r.instance_id,
                    route_token=r.route_token,
                )
                for r in partial
                if r.sample_id in applied
            ]
            zombie = (inst, dead)
            log["crashed"].append(inst)
            inst = p.register_instance(run, name + "-restarted", version, lease_seconds=10.0)
            lease = 10.0
            continue
        final = [r for r in final if r.sample_id in applied or r.sample_id not in {x.sample_id for x in partial}]
        done = _report(p, run, final, log)
        for r in done:
            if r.kind == SegmentKind.INTERRUPTED and rng.random() < 0.5:
                try:  # a retried (late) copy of an applied report: its route is gone
                    p.report(run, [r])
                    log["duplicate_accepted"].append(r.sample_id)
                except Conflict:
                    log["duplicate_fenced"].append(r.sample_id)
                break
    while zombie and not _late_report(p, engine, run, zombie, log) and time.monotonic() - start < DEADLINE_S:
        log["expired"] += p.expire_instances(run)  # the trainer may be gone already
        time.sleep(0.05)
    p.deregister_instance(inst)


def _late_report(p: Protocol, engine, run: int, zombie: tuple[int, list[Report]], log) -> bool:
    """Once the crashed instance is expired, its late report must be fenced off."""
    if _scalar(engine, "SELECT state::text FROM instances WHERE id = :i", i=zombie[0]) != "expired":
        return False
    try:
        p.report(run, zombie[1])
        log["zombie_accepted"].append(zombie[0])
    except Conflict:
        log["zombie_fenced"].append(zombie[0])
    return True


def _reward_body(p: Protocol, engine, run: int, name: str, stop, rng: random.Random, log) -> None:
    start = time.monotonic()
    while _running(stop, start):
        tasks = p.claim_rewards(run, limit=8)
        if not tasks:
            time.sleep(0.02)
            continue
        log["claimed"] += [[t.sample_id, t.reward_attempt] for t in tasks]
        for t in tasks:
            assert t.response_tokens == expected(t.sample_id, len(t.response_tokens)), t.sample_id
        pending = [(t.sample_id, t.reward_attempt, rng.choice([0.0, 0.5, 1.0])) for t in tasks]
        while pending:
            try:
                p.record_rewards(run, pending)
                log["recorded"] += [[s, a] for s, a, _ in pending]
                break
            except Conflict as e:  # aborted meanwhile (surplus member, dropped group)
                lost = {sid for sid, _ in e.items}
                log["lost"] += [[s, a] for s, a, _ in pending if s in lost]
                pending = [x for x in pending if x[0] not in lost]


def _trainer_body(p: Protocol, engine, run: int, name: str, stop, rng: random.Random, log) -> None:
    cfg, v, start = RunConfig(**CONFIG), 0, time.monotonic()
    # Train on until the crashed instance has been expired too (its lease is short).
    while (v < TARGET_VERSIONS or not log["expired"]) and _running(stop, start):
        log["expired"] += p.expire_instances(run)
        log["window_ready"] += p.abort_after_ready(run)
        batch = p.consume(run, v)
        if batch is None:
            time.sleep(0.02)
            continue
        assert len(batch.groups) == cfg.batch_size
        for g in batch.groups:
            assert len(g.samples) == cfg.group_size
            assert v - cfg.eta <= g.group_version <= v, (g.group_id, g.group_version, v)
            assert g.group_version == min(s.v_traj for s in g.samples)
            for s in g.samples:
                assert s.tokens == expected(s.sample_id, len(s.tokens)), s.sample_id
                assert s.logprobs == [logprob(i) for i in range(len(s.tokens))]
                versions = [seg.version for seg in s.segments]
                assert versions == sorted(versions) and versions[0] >= s.v_traj, (s.sample_id, versions)
                assert sum(seg.n_tokens for seg in s.segments) == len(s.tokens)
        assert p.publish(run, v, batch.consume_fence) == v + 1
        log["published"].append(v)
        v += 1
    stop.set()


def _rows(engine, sql: str, **params):
    with engine.connect() as c:
        return c.execute(text(sql), params).all()


def test_processes_share_one_run(engine, db_url, tmp_path):
    p = Protocol(engine)
    run = p.create_run("concurrent", RunConfig(**CONFIG))
    p.enqueue(run, [Prompt(f"q{i}", [1 + i % 7, 2, 3]) for i in range(PROMPTS)])

    stop = SPAWN.Event()
    roles = [("route", f"route-{i}") for i in range(ROUTE_WORKERS)]
    roles += [("reward", f"reward-{i}") for i in range(REWARD_WORKERS)] + [("trainer", "trainer")]
    procs = [
        SPAWN.Process(target=run_worker, args=(kind, db_url, run, name, str(tmp_path), stop, seed))
        for seed, (kind, name) in enumerate(roles)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(DEADLINE_S + 30)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)
    logs = {f.stem: json.loads(f.read_text()) for f in tmp_path.glob("*.json")}
    assert len(logs) == len(procs)
    errors = {n: log["error"][0] for n, log in logs.items() if "error" in log}
    assert not errors, "\n".join(f"--- {n}\n{e}" for n, e in errors.items())
    merged = defaultdict(list)
    for log in logs.values():
        for k, v in log.items():
            merged[k] += v

    # -- progress (not vacuous): the trainer got where it was told; each hazard happened --------
    versions = len(logs["trainer"]["published"])
    assert versions >= TARGET_VERSIONS, (p.reads.status(run), {k: len(v) for k, v in merged.items()})
    assert logs["trainer"]["published"] == list(range(versions))
    assert merged["crashed"] and merged["expired"], "the crashed instance was never expired"
    assert merged["zombie_fenced"] and not merged["zombie_accepted"]
    assert merged["duplicate_fenced"] and not merged["duplicate_accepted"]

    # -- no sample leased twice at once ---------------------------------------------------------
    received = [tuple(x) for x in merged["received"]]
    assert len(received) == len({(s, a) for s, a, _ in received}), "a route was delivered twice"
    routes = defaultdict(list)  # sample -> instance of attempt 1, 2, ... (route order = attempt order)
    events = _rows(
        engine,
        "SELECT sample_id, kind, instance_id FROM events WHERE run_id = :r AND sample_id IS NOT NULL ORDER BY id",
        r=run,
    )
    held: dict[int, bool] = defaultdict(bool)
    for sid, kind, inst in events:
        if kind == "sample_routed":
            assert not held[sid], f"sample {sid} routed while still leased"
            held[sid] = True
            routes[sid].append(inst)
        elif kind in ("sample_finished", "sample_interrupted", "sample_requeued"):
            assert held[sid], f"sample {sid}: {kind} without a route"
            held[sid] = False
        elif kind == "sample_aborted":
            held[sid] = False
    for sid, att, inst in received:
        assert routes[sid][att - 1] == inst, (sid, att)
    attempts = dict(_rows(engine, "SELECT id, attempt FROM samples WHERE run_id = :r", r=run))
    assert all(attempts[s] == len(routes.get(s, [])) for s in attempts)
    running = _rows(engine, "SELECT id, instance_id FROM samples WHERE run_id = :r AND state = 'running'", r=run)
    assert all(held[sid] and routes[sid][-1] == inst for sid, inst in running)

    # -- segments: each from the lease's own instance, attempts in order, exactly those acked ----
    segs = _rows(
        engine,
        "SELECT sample_id, seq, attempt, instance_id, version, token_ids FROM segments"
        " WHERE run_id = :r ORDER BY sample_id, seq",
        r=run,
    )
    by_sample = defaultdict(list)
    for sid, seq, att, inst, ver, toks in segs:
        assert routes[sid][att - 1] == inst, (sid, seq)
        by_sample[sid].append((seq, att, ver, unpack_tokens(toks)))
    for sid, parts in by_sample.items():
        assert [x[0] for x in parts] == list(range(len(parts)))
        assert [x[1] for x in parts] == sorted(x[1] for x in parts), sid  # attempts never go back
    acked = sorted((s, a, tuple(t)) for s, a, t in merged["segments"])
    assert acked == sorted((s, a, tuple(unpack_tokens(t))) for s, _, a, _, _, t in segs), "segments lost or duplicated"

    # -- nothing lost --------------------------------------------------------------------------
    samples = _rows(
        engine, "SELECT id, state::text, n_tokens, n_segments, reason FROM samples WHERE run_id = :r", r=run
    )
    for sid, state, n, nseg, reason in samples:
        parts = by_sample.get(sid, [])
        assert [x for *_, seg in parts for x in seg] == expected(sid, n) and nseg == len(parts), sid
        assert state != "aborted" or reason, sid
    groups = _rows(engine, "SELECT id, state::text, reason, replacement_of FROM prompt_groups WHERE run_id = :r", r=run)
    states = defaultdict(int)
    for gid, state, reason, _ in groups:
        states[state] += 1
        assert state in ("consumed", "filtered", "aborted", "queued", "reserved", "occupied"), gid
        assert state not in ("filtered", "aborted") or reason, gid
    replaced = {r for *_, r in groups if r is not None}
    assert {g for g, s, *_ in groups if s == "filtered"} == replaced  # each filtered prompt came back
    assert len(groups) == PROMPTS + len(replaced)
    assert states["consumed"] == versions * CONFIG["batch_size"]
    trained = _rows(engine, "SELECT group_id, count(*) FROM trained_samples WHERE run_id = :r GROUP BY 1", r=run)
    assert len(trained) == states["consumed"] and all(n == CONFIG["group_size"] for _, n in trained)
    assert {s for s, _ in merged["recorded"]} >= {s for s, st, *_ in samples if st == "rewarded"}
    claims = [tuple(c) for c in merged["claimed"]]
    assert len(claims) == len(set(claims)), "a reward claim was handed out twice"

    # -- the bound and the versions ------------------------------------------------------------
    assert _rows(engine, "SELECT * FROM staleness_violations WHERE run_id = :r", r=run) == []
    assert _rows(engine, "SELECT version FROM runs WHERE id = :r", r=run) == [(versions,)]
    consumed = _rows(
        engine, "SELECT idx FROM buffers WHERE run_id = :r AND consumed_at IS NOT NULL ORDER BY idx", r=run
    )
    assert [b for (b,) in consumed] == list(range(versions))
    published = _rows(engine, "SELECT version FROM param_versions WHERE run_id = :r ORDER BY version", r=run)
    assert [v for (v,) in published] == list(range(1, versions + 1))
    print(
        {k: len(v) for k, v in merged.items()},
        dict(states),
        {o: merged["route_outcomes"].count(o) for o in set(merged["route_outcomes"])},
    )
