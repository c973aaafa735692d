"""Rollout side of the protocol: runs, prompts, instances, routing (Reserve), segment reports
and work delivery."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from sqlalchemy import Connection, text
from sqlalchemy.exc import IntegrityError

from ..enums import SegmentKind
from ..errors import Conflict, InvalidInput, NotFound, TooLarge
from ..rules import group_version, route_decision
from ..types import Report, RouteOutcome, RouteResult, RunConfig
from .base import RunTx, TxMixin, load_run, log_events, response_so_far, send_commands, under_run_lock

MAX_BATCH = 10_000  # items per call: larger batches hold the run lock too long


@dataclass
class Prompt:
    client_key: str
    prompt_tokens: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Work:
    """A routed sample as its instance receives it: continue after `prefix_tokens`."""

    sample_id: int
    attempt: int
    group_id: int
    v_traj: int
    prompt_tokens: list[int]
    prefix_tokens: list[int]
    prefix_logprobs: list[float]
    max_new_tokens: int


@dataclass
class Command:
    id: int
    kind: str
    sample_id: int | None
    attempt: int | None
    target_version: int | None


def check_batch(items: Sequence, what: str) -> None:
    if len(items) > MAX_BATCH:
        raise TooLarge(f"{len(items)} {what} in one call (at most {MAX_BATCH})")


class RolloutOps(TxMixin):
    # ---- runs and prompts ------------------------------------------------------------------

    def create_run(self, name: str, config: RunConfig) -> int:
        config.validate()
        if not name or len(name) > 200:
            raise InvalidInput("run name must have 1..200 characters")
        with self.tx() as conn:
            try:
                with conn.begin_nested():
                    run_id = conn.execute(
                        text(
                            "INSERT INTO runs (name, batch_size, buffer_capacity, group_size, samples_per_group,"
                            " eta, max_response_tokens, max_prompt_tokens, dapo_filter)"
                            " VALUES (:name, :B, :Bc, :N, :Nc, :eta, :mr, :mp, :f) RETURNING id"
                        ),
                        {
                            "name": name,
                            "B": config.batch_size,
                            "Bc": config.buffer_capacity,
                            "N": config.group_size,
                            "Nc": config.samples_per_group,
                            "eta": config.eta,
                            "mr": config.max_response_tokens,
                            "mp": config.max_prompt_tokens,
                            "f": config.dapo_filter,
                        },
                    ).scalar_one()
            except IntegrityError:
                raise Conflict([(0, f"a run named {name!r} exists already")]) from None
            log_events(conn, run_id, [("run_created", None, None, None, None, {"name": name})])
            return run_id

    def enqueue(self, run_id: int, prompts: Sequence[Prompt]) -> list[int]:
        """Group ids for the prompts, in order; a client key seen before returns its group."""
        check_batch(prompts, "prompts")
        with self.tx() as conn:
            run = load_run(conn, run_id, lock=False)
            return enqueue_prompts(conn, run, prompts)

    # ---- instances -------------------------------------------------------------------------

    def register_instance(self, run_id: int, name: str, version: int, lease_seconds: float = 30.0) -> int:
        """A new instance id per process start; a restarted worker never inherits a lease."""
        with self.tx() as conn:
            run = load_run(conn, run_id, lock=False)
            if not 0 <= version <= run.version:
                raise InvalidInput(f"instance version {version} outside 0..{run.version}")
            iid = conn.execute(
                text(
                    "INSERT INTO instances (run_id, name, version, lease_expires_at)"
                    " VALUES (:run, :name, :v, now() + make_interval(secs => :ttl)) RETURNING id"
                ),
                {"run": run_id, "name": name, "v": version, "ttl": lease_seconds},
            ).scalar_one()
            log_events(conn, run_id, [("instance_registered", None, None, None, iid, {"name": name, "version": version})])
            return iid

    def heartbeat(
        self, instance_id: int, version: int, snapshot: dict | None = None, lease_seconds: float = 30.0
    ) -> None:
        """Extend the lease and store the latest snapshot. Ephemeral: no synchronous commit."""
        with self.tx() as conn:
            conn.execute(text("SET LOCAL synchronous_commit = off"))
            row = conn.execute(
                text("SELECT i.state, i.version, r.version FROM instances i JOIN runs r ON r.id = i.run_id WHERE i.id = :i"),
                {"i": instance_id},
            ).first()
            if row is None:
                raise NotFound(f"instance {instance_id}")
            state, current, run_version = row
            if state != "active":
                raise Conflict([(instance_id, f"instance is {state}; register again")])
            if not current <= version <= run_version:
                raise InvalidInput(f"instance version {version} outside {current}..{run_version}")
            updated = conn.execute(
                text(
                    "UPDATE instances SET version = :v, snapshot = CAST(:snap AS jsonb), snapshot_at = now(),"
                    " lease_expires_at = now() + make_interval(secs => :ttl)"
                    " WHERE id = :i AND state = 'active' AND lease_expires_at > now() RETURNING id"
                ),
                {"i": instance_id, "v": version, "snap": json.dumps(snapshot or {}), "ttl": lease_seconds},
            ).first()
            if updated is None:
                raise Conflict([(instance_id, "instance lease expired; register again")])

    def expire_instances(self, run_id: int) -> list[int]:
        """Fence every instance whose lease ran out; its samples go back to the queue."""
        with self.tx() as conn:
            ids = conn.execute(
                text(
                    "UPDATE instances SET state = 'expired' WHERE run_id = :run AND state = 'active'"
                    " AND lease_expires_at <= now() RETURNING id"
                ),
                {"run": run_id},
            ).scalars().all()
            requeue_instances(conn, run_id, ids, "instance_expired")
            return sorted(ids)

    def deregister_instance(self, instance_id: int) -> list[int]:
        """A clean shutdown: the instance's running samples go back to the queue at once."""
        with self.tx() as conn:
            row = conn.execute(
                text(
                    "UPDATE instances SET state = 'deregistered' WHERE id = :i AND state = 'active' RETURNING run_id"
                ),
                {"i": instance_id},
            ).first()
            if row is None:
                if conn.execute(text("SELECT 1 FROM instances WHERE id = :i"), {"i": instance_id}).first() is None:
                    raise NotFound(f"instance {instance_id}")
                return []
            return requeue_instances(conn, row[0], [instance_id], "instance_deregistered")

    # ---- route (Reserve) -------------------------------------------------------------------

    def route(self, run_id: int, pairs: Sequence[tuple[int, int]], request_id: str | None = None) -> list[RouteResult]:
        """Route queued samples to instances; the group's first member reserves a buffer entry."""
        check_batch(pairs, "routes")
        return self.idempotent(
            request_id, "route", under_run_lock(run_id, lambda rtx: route_in(rtx, pairs)), lambda stored: [RouteResult(**{**r, "outcome": RouteOutcome(r["outcome"])}) for r in stored]
        )

    # ---- segments --------------------------------------------------------------------------

    def report(self, run_id: int, reports: Sequence[Report], request_id: str | None = None) -> int:
        """Append segments, fenced by attempt; all or nothing. Returns the number applied."""
        check_batch(reports, "reports")
        return self.idempotent(request_id, "report", lambda conn: report_in(conn, run_id, reports), int)

    def poll_work(self, instance_id: int, limit: int = 1000) -> tuple[list[Work], list[Command]]:
        """Deliver newly routed samples (with any prefix to continue from) and pending commands."""
        with self.tx() as conn:
            row = conn.execute(
                text("SELECT i.state, r.max_response_tokens FROM instances i JOIN runs r ON r.id = i.run_id WHERE i.id = :i"),
                {"i": instance_id},
            ).first()
            if row is None:
                raise NotFound(f"instance {instance_id}")
            if row[0] != "active":
                raise Conflict([(instance_id, f"instance is {row[0]}; register again")])
            rows = conn.execute(
                text(
                    "WITH d AS MATERIALIZED (SELECT id FROM samples WHERE instance_id = :i AND state = 'running'"
                    "   AND NOT delivered ORDER BY id LIMIT :n FOR UPDATE),"
                    " u AS (UPDATE samples s SET delivered = true FROM d WHERE s.id = d.id"
                    "   RETURNING s.id, s.attempt, s.group_id, s.v_traj, s.n_tokens)"
                    " SELECT u.id, u.attempt, u.group_id, u.v_traj, u.n_tokens, g.prompt_tokens,"
                    f"  {response_so_far('token_ids', 'u.id')}, {response_so_far('logprobs', 'u.id')}"
                    " FROM u JOIN prompt_groups g ON g.id = u.group_id ORDER BY u.id"
                ),
                {"i": instance_id, "n": limit},
            ).all()
            work = [
                Work(sid, att, gid, v, list(prompt), list(toks), list(lps), row[1] - n)
                for sid, att, gid, v, n, prompt, toks, lps in rows
            ]
            cmds = conn.execute(
                text(
                    "UPDATE commands SET state = 'delivered', delivered_at = now()"
                    " WHERE id IN (SELECT id FROM commands WHERE instance_id = :i AND state = 'pending'"
                    "   ORDER BY id FOR UPDATE) RETURNING id, kind, sample_id, attempt, target_version"
                ),
                {"i": instance_id},
            ).all()
            return work, sorted((Command(*c) for c in cmds), key=lambda c: c.id)

    def interrupt(self, run_id: int, sample_ids: Sequence[int]) -> int:
        """Ask the instances running these samples to interrupt them (they report what they have)."""
        with self.tx() as conn:
            return interrupt_running(conn, run_id, sample_ids, None)


def interrupt_running(conn: Connection, run_id: int, sample_ids: Sequence[int], epoch: int | None) -> int:
    """Queue interrupt commands for those of the samples that are running; returns how many."""
    rows = conn.execute(
        text(
            "SELECT id, instance_id, attempt FROM samples WHERE run_id = :run AND state = 'running'"
            " AND id = ANY(CAST(:ids AS bigint[]))"
        ),
        {"run": run_id, "ids": list(sample_ids)},
    ).all()
    send_commands(conn, run_id, "interrupt", [tuple(r) for r in rows], epoch)
    return len(rows)


def enqueue_prompts(conn: Connection, run, prompts: Sequence[Prompt], replacement_of: Sequence[int] | None = None) -> list[int]:
    for p in prompts:
        if not p.client_key or len(p.client_key) > 500:
            raise InvalidInput("client_key must have 1..500 characters")
        if not 1 <= len(p.prompt_tokens) <= run.max_prompt_tokens:
            raise InvalidInput(f"prompt {p.client_key!r}: {len(p.prompt_tokens)} tokens (allowed 1..{run.max_prompt_tokens})")
        if any(not isinstance(t, int) or t < 0 or t >= 2**31 for t in p.prompt_tokens):
            raise InvalidInput(f"prompt {p.client_key!r}: token ids must be integers in 0..2^31-1")
    if len({p.client_key for p in prompts}) != len(prompts):
        raise InvalidInput("a client_key appears twice in one batch")
    payload = json.dumps(
        [
            {"o": i, "k": p.client_key, "t": p.prompt_tokens, "m": p.meta, "r": replacement_of[i] if replacement_of else None}
            for i, p in enumerate(prompts)
        ]
    )
    created = conn.execute(
        text(
            "WITH g AS (INSERT INTO prompt_groups (run_id, client_key, prompt_tokens, meta, replacement_of)"
            "   SELECT :run, x.k, x.t, coalesce(x.m, '{}'), x.r"
            "   FROM jsonb_to_recordset(CAST(:p AS jsonb)) AS x(o int, k text, t int[], m jsonb, r bigint)"
            "   ORDER BY x.o ON CONFLICT (run_id, client_key) DO NOTHING RETURNING id, client_key),"
            " s AS (INSERT INTO samples (run_id, group_id, idx)"
            "   SELECT :run, g.id, i FROM g, generate_series(0, :n - 1) AS i ORDER BY g.id, i)"
            " SELECT id, client_key FROM g"
        ),
        {"run": run.id, "p": payload, "n": run.samples_per_group},
    ).all()
    log_events(conn, run.id, [("group_enqueued", None, gid, None, None, None) for gid, _ in created])
    ids = dict((k, g) for g, k in created)
    missing = [p.client_key for p in prompts if p.client_key not in ids]
    if missing:
        ids.update(
            (k, g)
            for g, k in conn.execute(
                text("SELECT id, client_key FROM prompt_groups WHERE run_id = :run AND client_key = ANY(:keys)"),
                {"run": run.id, "keys": missing},
            ).all()
        )
    return [ids[p.client_key] for p in prompts]


def requeue_instances(conn: Connection, run_id: int, instance_ids: Sequence[int], why: str) -> list[int]:
    """Running samples of fenced instances return to the queue with the tokens they reported."""
    if not instance_ids:
        return []
    rows = conn.execute(
        text(
            "UPDATE samples SET state = 'queued', instance_id = NULL, updated_at = now()"
            " WHERE id IN (SELECT id FROM samples WHERE instance_id = ANY(CAST(:ids AS bigint[]))"
            "   AND state = 'running' ORDER BY id FOR UPDATE) RETURNING id"
        ),
        {"ids": list(instance_ids)},
    ).scalars().all()
    events = [(why, None, None, None, i, None) for i in instance_ids]
    events += [("sample_requeued", s, None, None, None, {"why": why}) for s in rows]
    log_events(conn, run_id, events)
    return sorted(rows)


def route_in(rtx: RunTx, pairs: Sequence[tuple[int, int]]) -> list[RouteResult]:
    conn, run = rtx.conn, rtx.run
    sample_ids = [p[0] for p in pairs]
    if len(set(sample_ids)) != len(sample_ids):
        raise InvalidInput("a sample appears twice in one route batch")
    samples = {
        r[0]: r
        for r in conn.execute(
            text(
                "SELECT s.id, s.group_id, s.state, s.v_traj, s.n_tokens, s.last_version FROM samples s"
                " WHERE s.run_id = :run AND s.id = ANY(CAST(:ids AS bigint[])) ORDER BY s.id FOR UPDATE"
            ),
            {"run": run.id, "ids": sample_ids},
        ).all()
    }
    instances = {
        r[0]: r
        for r in conn.execute(
            text("SELECT id, state, version FROM instances WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))"),
            {"run": run.id, "ids": list({p[1] for p in pairs})},
        ).all()
    }
    for sid, iid in pairs:
        if sid not in samples:
            raise NotFound(f"sample {sid} in run {run.id}")
        if iid not in instances:
            raise NotFound(f"instance {iid} in run {run.id}")
    groups = {
        r[0]: list(r)
        for r in conn.execute(
            text(
                "SELECT id, state, reserved_buffer, min_version FROM prompt_groups"
                " WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id FOR UPDATE"
            ),
            {"ids": list({s[1] for s in samples.values()})},
        ).all()
    }
    # live members of the reserved groups: the group version after the route (min_version)
    members: dict[int, dict[int, tuple[str, int | None, int]]] = {}
    reserved = [gid for gid, g in groups.items() if g[1] == "reserved"]
    if reserved:
        for m, gid, st, v, n in conn.execute(
            text(
                "SELECT id, group_id, state::text, v_traj, n_tokens FROM samples"
                " WHERE group_id = ANY(CAST(:g AS bigint[])) AND state <> 'aborted' AND v_traj IS NOT NULL"
            ),
            {"g": reserved},
        ).all():
            members.setdefault(gid, {})[m] = (st, v, n)
    results, routed, touched = [], [], set()
    for sid, iid in pairs:
        _, gid, state, v_traj, n_tokens, last_version = samples[sid]
        _, inst_state, inst_version = instances[iid]
        g = groups[gid]
        if state != "queued":
            results.append(RouteResult(sid, RouteOutcome.NOT_QUEUED))
            continue
        if inst_state != "active":
            results.append(RouteResult(sid, RouteOutcome.INSTANCE_INACTIVE))
            continue
        if g[1] not in ("queued", "reserved"):
            results.append(RouteResult(sid, RouteOutcome.GROUP_CLOSED))
            continue
        # the group rows (locked above) carry the reservation: route moves none, so no need to
        # read all of the run's reservations inside the serial section
        reserved_at = g[2] if g[1] == "reserved" else None
        live = members.setdefault(gid, {})
        outcome, v, b = route_decision(
            n_tokens > 0, v_traj, last_version, inst_version, reserved_at, rtx.buffers, run.version, run.limits
        )
        if outcome != RouteOutcome.ROUTED:
            results.append(RouteResult(sid, RouteOutcome(outcome)))
            continue
        live[sid] = ("running", v, n_tokens)
        g[3] = group_version(live.values())  # raised if this member was the oldest (version raise)
        if b is not None:
            g[1], g[2] = "reserved", b
            rtx.add_reservation(gid, b, g[3])
            rtx.events.append(("group_reserved", None, gid, b, None, {"version": v}))
        else:
            rtx.set_group_version(gid, g[3])
        touched.add(gid)
        routed.append((sid, v, iid))
        results.append(RouteResult(sid, RouteOutcome.ROUTED, None, v, g[2]))
    if routed:
        attempts = dict(
            conn.execute(
                text(
                    "UPDATE samples s SET state = 'running', v_traj = u.v, instance_id = u.i, attempt = s.attempt + 1,"
                    " delivered = false, updated_at = now()"
                    " FROM unnest(CAST(:ids AS bigint[]), CAST(:vs AS int[]), CAST(:is AS bigint[])) AS u(id, v, i)"
                    " WHERE s.id = u.id RETURNING s.id, s.attempt"
                ),
                {"ids": [r[0] for r in routed], "vs": [r[1] for r in routed], "is": [r[2] for r in routed]},
            ).all()
        )
        for r in results:
            if r.outcome == RouteOutcome.ROUTED:
                r.attempt = attempts[r.sample_id]
        tg = sorted(touched)
        conn.execute(
            text(
                "UPDATE prompt_groups g SET state = 'reserved', reserved_buffer = u.b, min_version = u.mv"
                " FROM unnest(CAST(:ids AS bigint[]), CAST(:bs AS int[]), CAST(:mvs AS int[])) AS u(id, b, mv)"
                " WHERE g.id = u.id"
            ),
            {"ids": tg, "bs": [groups[g][2] for g in tg], "mvs": [groups[g][3] for g in tg]},
        )
        rtx.events.extend(("sample_routed", sid, None, None, iid, {"v": v}) for sid, v, iid in routed)
    return results


def report_in(conn: Connection, run_id: int, reports: Sequence[Report]) -> int:
    run = load_run(conn, run_id, lock=False)
    ids = [r.sample_id for r in reports]
    if len(set(ids)) != len(ids):
        raise InvalidInput("a sample appears twice in one report batch")
    for r in reports:
        r.check_shape()
        if r.kind not in tuple(SegmentKind):
            raise InvalidInput(f"sample {r.sample_id}: unknown kind {r.kind!r}")
    cols = "SELECT id, state, attempt, v_traj, last_version, n_tokens, n_segments, instance_id FROM samples"
    # Lock only the running rows: those are all a report can change. A stale report naming a
    # sample that moved on (scoring, aborted ...) must not wait on its lock: with the run-locked
    # record_rewards, which holds scoring rows and then locks their groups' members, that
    # wait closed a deadlock cycle. The rest are read unlocked, only to refuse them.
    rows = {
        r[0]: r
        for r in conn.execute(
            text(
                f"{cols} WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[])) AND state = 'running'"
                " ORDER BY id FOR UPDATE"
            ),
            {"run": run_id, "ids": ids},
        ).all()
    }
    missing = [i for i in ids if i not in rows]
    if missing:
        rows.update(
            (r[0], r)
            for r in conn.execute(
                text(f"{cols} WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))"), {"run": run_id, "ids": missing}
            ).all()
        )
    conflicts = []
    for r in reports:
        row = rows.get(r.sample_id)
        if row is None:
            raise NotFound(f"sample {r.sample_id} in run {run_id}")
        _, state, attempt, v_traj, last, n_tokens, _, _ = row
        if state != "running" or attempt != r.attempt:
            conflicts.append((r.sample_id, "lease lost (stale attempt or sample not running)"))
            continue
        floor = last if last is not None else v_traj
        if not floor <= r.version <= run.version:
            raise InvalidInput(f"sample {r.sample_id}: segment version {r.version} outside {floor}..{run.version}")
        if n_tokens + len(r.tokens) > run.max_response_tokens:
            raise TooLarge(f"sample {r.sample_id}: response over {run.max_response_tokens} tokens")
    if conflicts:
        raise Conflict(conflicts)
    segs = [r for r in reports if r.tokens]
    if segs:
        payload = json.dumps(
            [
                {
                    "s": r.sample_id, "q": rows[r.sample_id][6], "v": r.version, "i": rows[r.sample_id][7],
                    "a": r.attempt, "t": r.tokens, "l": r.logprobs, "f": r.finish_reason,
                }
                for r in segs
            ]
        )
        conn.execute(
            text(
                "INSERT INTO segments (sample_id, seq, run_id, version, instance_id, attempt, token_ids, logprobs, finish_reason)"
                " SELECT x.s, x.q, :run, x.v, x.i, x.a, x.t, x.l, x.f"
                " FROM jsonb_to_recordset(CAST(:p AS jsonb)) AS x(s bigint, q int, v int, i bigint, a int, t int[], l real[], f text)"
            ),
            {"run": run_id, "p": payload},
        )
    state_of = {SegmentKind.FINISHED: "finished", SegmentKind.INTERRUPTED: "queued", SegmentKind.PARTIAL: "running"}
    conn.execute(
        text(
            "UPDATE samples s SET n_tokens = s.n_tokens + u.n, n_segments = s.n_segments + (u.n > 0)::int,"
            " last_version = CASE WHEN u.n > 0 THEN u.v ELSE s.last_version END,"
            " state = CAST(u.st AS sample_state), instance_id = CASE WHEN u.st = 'running' THEN s.instance_id END,"
            " finish_reason = coalesce(u.f, s.finish_reason), updated_at = now()"
            " FROM unnest(CAST(:ids AS bigint[]), CAST(:ns AS int[]), CAST(:vs AS int[]), CAST(:sts AS text[]),"
            "   CAST(:fs AS text[])) AS u(id, n, v, st, f)"
            " WHERE s.id = u.id"
        ),
        {
            "ids": ids,
            "ns": [len(r.tokens) for r in reports],
            "vs": [r.version for r in reports],
            "sts": [state_of[SegmentKind(r.kind)] for r in reports],
            "fs": [r.finish_reason for r in reports],
        },
    )
    log_events(
        conn,
        run_id,
        [
            (f"sample_{SegmentKind(r.kind).value}", r.sample_id, None, None, rows[r.sample_id][7], {"n": len(r.tokens), "v": r.version})
            for r in reports
            if r.kind != SegmentKind.PARTIAL
        ],
    )
    return len(reports)
