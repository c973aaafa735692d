"""Rollout side of the protocol: runs, prompts, instances, routing (Reserve), segment reports
and work delivery."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from workers.wire.types import RouteOutcome

from .. import queries
from ..errors import Conflict, InvalidInput, NotFound, TooLarge
from ..idempotency import transactional
from ..types import Report, RouteResult, RunConfig
from .base import TxMixin, load_run, under_run_lock
from .events import Event, log_events
from .fencing import check_live, report_in
from .routing import route_in, route_read, route_tokens

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
    route_token: str  # secret token of this route: every report on it must quote it
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


@dataclass
class Poll:
    """What one poll delivers to its instance: the one shape of a poll reply, each part empty
    when there is none of it (an empty poll is `Poll()`); the API's PollOut has these fields."""

    work: list[Work] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)


def check_batch(items: Sequence, what: str) -> None:
    if len(items) > MAX_BATCH:
        raise TooLarge(f"{len(items)} {what} in one call (at most {MAX_BATCH})")


def check_unique(ids: Sequence[int], what: str, call: str) -> None:
    """InvalidInput naming the first id that appears twice in one batch."""
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise InvalidInput(f"{what} {i} appears twice in one {call} batch")
        seen.add(i)


class RolloutOps(TxMixin):
    # ---- runs and prompts ------------------------------------------------------------------

    @transactional
    def create_run(self, name: str, config: RunConfig, *, conn: Connection | None = None) -> int:
        config.validate()
        if not name or len(name) > 200:
            raise InvalidInput("run name must have 1..200 characters")
        with self.tx(conn) as conn:
            try:
                with conn.begin_nested():
                    run_id = conn.execute(
                        queries.text("create_run"),
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
            log_events(conn, run_id, [Event("run_created", data={"name": name})])
            return run_id

    @transactional
    def enqueue(self, run_id: int, prompts: Sequence[Prompt], *, conn: Connection | None = None) -> list[int]:
        """Group ids for the prompts, in order; a client key seen before returns its group."""
        check_batch(prompts, "prompts")
        with self.tx(conn) as conn:
            run = load_run(conn, run_id, lock=False)
            return enqueue_prompts(conn, run, prompts)

    # ---- instances -------------------------------------------------------------------------

    @transactional
    def register_instance(
        self,
        run_id: int,
        name: str,
        version: int,
        lease_seconds: float = 30.0,
        token_id: int | None = None,
        *,
        conn: Connection | None = None,
    ) -> int:
        """A new instance id per process start; a restarted worker never inherits a lease.
        `token_id`: the API token registering it (the API lets only that token act for it)."""
        with self.tx(conn) as conn:
            run = load_run(conn, run_id, lock=False)
            if not 0 <= version <= run.version:
                raise InvalidInput(f"instance version {version} outside 0..{run.version}")
            iid = conn.execute(
                queries.text("register_instance"),
                {"run": run_id, "name": name, "v": version, "ttl": lease_seconds, "tok": token_id},
            ).scalar_one()
            log_events(
                conn, run_id, [Event("instance_registered", instance=iid, data={"name": name, "version": version})]
            )
            return iid

    @transactional
    def heartbeat(
        self,
        instance_id: int,
        version: int,
        snapshot: dict | None = None,
        lease_seconds: float = 30.0,
        *,
        conn: Connection | None = None,
    ) -> None:
        """Extend a live lease and store the latest snapshot. Ephemeral: no synchronous commit.

        Every condition sits in the UPDATE itself, re-checked on the row it finally locks: two
        overlapping heartbeats can never move the version backwards (a plain read before the
        update could be stale by then) nor revive a lease that lapsed meanwhile."""
        with self.tx(conn) as conn:
            conn.execute(queries.text("heartbeat_ephemeral"))
            updated = conn.execute(
                queries.text("heartbeat"),
                {"i": instance_id, "v": version, "snap": json.dumps(snapshot or {}), "ttl": lease_seconds},
            ).first()
            if updated is not None:
                return
            row = conn.execute(queries.text("heartbeat_refused"), {"i": instance_id}).first()
            if row is None:
                raise NotFound(f"instance {instance_id}")
            check_live(instance_id, row.state, row.live)
            raise InvalidInput(f"instance version {version} outside {row.version}..{row.run_version}")

    @transactional
    def expire_instances(self, run_id: int, *, conn: Connection | None = None) -> list[int]:
        """Tidy up after lapsed leases: mark those instances expired, and requeue every sample
        still running on any instance that is not active.

        The lease itself is enforced by time in every instance-scoped operation (route, poll,
        report, heartbeat): a lapsed instance is refused before this sweep runs. The sweep only
        gives its samples back to the queue, and also those of any instance fenced earlier
        (a straggler a concurrent route left behind must not stay running forever)."""
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            ids = conn.execute(queries.text("expire_instances"), {"run": run_id}).scalars().all()
            log_events(conn, run_id, [Event("instance_expired", instance=i) for i in sorted(ids)])
            requeue_fenced(conn, run_id, "instance_expired")
            return sorted(ids)

    @transactional
    def deregister_instance(self, instance_id: int, *, conn: Connection | None = None) -> list[int]:
        """A clean shutdown: the instance's running samples go back to the queue at once."""
        with self.tx(conn) as conn:
            row = conn.execute(queries.text("deregister_instance"), {"i": instance_id}).first()
            if row is None:
                if conn.execute(queries.text("instance_exists"), {"i": instance_id}).first() is None:
                    raise NotFound(f"instance {instance_id}")
                return []
            log_events(conn, row.run_id, [Event("instance_deregistered", instance=instance_id)])
            return requeue_fenced(conn, row.run_id, "instance_deregistered", [instance_id])

    # ---- route (Reserve) -------------------------------------------------------------------

    @transactional
    def route(
        self,
        run_id: int,
        pairs: Sequence[tuple[int, int]],
        request_id: str | None = None,
        *,
        conn: Connection | None = None,
    ) -> list[RouteResult]:
        """Route queued samples to instances; the group's first member reserves a buffer entry."""
        check_batch(pairs, "routes")
        tokens = route_tokens(len(pairs))
        return self.idempotent(
            request_id,
            "route",
            under_run_lock(run_id, lambda rtx: route_in(rtx, pairs, tokens), route_read(pairs)),
            lambda stored: [RouteResult(**{**r, "outcome": RouteOutcome(r["outcome"])}) for r in stored],
            body=[run_id, pairs],
            conn=conn,
        )

    # ---- segments --------------------------------------------------------------------------

    @transactional
    def report(
        self, run_id: int, reports: Sequence[Report], request_id: str | None = None, *, conn: Connection | None = None
    ) -> int:
        """Append segments, each fenced by its reporting instance (routed to it, lease live),
        attempt and route token; all or nothing. Returns the number applied."""
        check_batch(reports, "reports")
        return self.idempotent(
            request_id, "report", lambda c: report_in(c, run_id, reports), int, body=[run_id, reports], conn=conn
        )

    @transactional
    def poll_work(self, instance_id: int, limit: int = 1000, *, conn: Connection | None = None) -> Poll:
        """Deliver newly routed samples (with any prefix to continue from) and pending commands."""
        with self.tx(conn) as conn:
            # One statement checks the instance and delivers. FOR SHARE: the instance stays
            # active and live until this delivery commits (an expiry waits for it, then requeues
            # what was delivered). Its check is a one-time filter on the samples' scan, so it is
            # locked before any sample (lock order instances -> samples) and a fenced instance
            # gets nothing. One row per delivered sample, or one with no sample at all; none
            # when there is no such instance.
            rows = conn.execute(queries.text("poll_work"), {"i": instance_id, "n": limit}).all()
            if not rows:
                raise NotFound(f"instance {instance_id}")
            row = rows[0]
            check_live(instance_id, row.state, row.live)
            work = [
                Work(
                    w.id,
                    w.attempt,
                    w.route_token,
                    w.group_id,
                    w.v_traj,
                    list(w.prompt_tokens),
                    list(w.tokens),
                    list(w.logprobs),
                    row.max_response_tokens - w.n_tokens,
                )
                for w in rows
                if w.id is not None
            ]
            cmds = conn.execute(queries.text("deliver_commands"), {"i": instance_id}).all()
            return Poll(work, sorted((Command(**c._mapping) for c in cmds), key=lambda c: c.id))

    @transactional
    def interrupt(
        self, run_id: int, sample_ids: Sequence[int], epoch: int | None = None, *, conn: Connection | None = None
    ) -> int:
        """Ask the instances running these samples to interrupt them (they report what they
        have); returns how many were running. `epoch`: the coordinator's, kept on the commands."""
        check_unique(sample_ids, "sample", "interrupt")
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            return interrupt_running(conn, run_id, sample_ids, epoch)


def interrupt_running(conn: Connection, run_id: int, sample_ids: Sequence[int], epoch: int | None) -> int:
    """Queue interrupt commands for those of the samples that are running; returns how many.
    A sample that is not in the run (unknown, or another run's) is NotFound, as everywhere."""
    # One statement reads the samples and queues the commands (a decision-delay round trip
    # less for the coordinator); one not found rolls the whole transaction back.
    rows = conn.execute(
        queries.text("interrupt_running"),
        {"run": run_id, "ids": list(sample_ids), "epoch": epoch},
    ).all()
    check_found(run_id, sample_ids, {r.id for r in rows})
    return sum(r.running for r in rows)


def check_found(run_id: int, sample_ids: Sequence[int], found: set[int]) -> None:
    missing = [sid for sid in sample_ids if sid not in found]
    if missing:
        raise NotFound(f"sample {missing[0]} in run {run_id}")


def enqueue_prompts(
    conn: Connection, run, prompts: Sequence[Prompt], replacement_of: Sequence[int] | None = None
) -> list[int]:
    for p in prompts:
        if not p.client_key or len(p.client_key) > 500:
            raise InvalidInput("client_key must have 1..500 characters")
        if replacement_of is None and p.client_key.startswith("~"):
            raise InvalidInput(f"client_key {p.client_key!r}: keys starting with '~' are reserved for replacements")
        if not 1 <= len(p.prompt_tokens) <= run.max_prompt_tokens:
            raise InvalidInput(
                f"prompt {p.client_key!r}: {len(p.prompt_tokens)} tokens (allowed 1..{run.max_prompt_tokens})"
            )
        if any(not isinstance(t, int) or t < 0 or t >= 2**31 for t in p.prompt_tokens):
            raise InvalidInput(f"prompt {p.client_key!r}: token ids must be integers in 0..2^31-1")
    if len({p.client_key for p in prompts}) != len(prompts):
        raise InvalidInput("a client_key appears twice in one batch")
    payload = json.dumps(
        [
            {
                "o": i,
                "k": p.client_key,
                "t": p.prompt_tokens,
                "m": p.meta,
                "r": replacement_of[i] if replacement_of else None,
            }
            for i, p in enumerate(prompts)
        ]
    )
    created = conn.execute(
        queries.text("enqueue_groups"),
        {"run": run.id, "p": payload, "n": run.samples_per_group},
    ).all()
    log_events(conn, run.id, [Event("group_enqueued", group=gid) for gid, _ in created])
    ids = dict((k, g) for g, k in created)
    missing = [p.client_key for p in prompts if p.client_key not in ids]
    if missing:
        ids.update(
            (k, g)
            for g, k in conn.execute(
                queries.text("groups_by_key"),
                {"run": run.id, "keys": missing},
            ).all()
        )
    return [ids[p.client_key] for p in prompts]


def requeue_fenced(conn: Connection, run_id: int, why: str, instance_ids: Sequence[int] | None = None) -> list[int]:
    """Samples running on fenced (non-active) instances of the run, or only on `instance_ids`
    (already fenced in this transaction), return to the queue with the tokens they reported."""
    rows = conn.execute(
        queries.text("requeue_fenced" if instance_ids is None else "requeue_instances"),
        {"run": run_id, "ids": list(instance_ids or [])},
    ).all()
    log_events(
        conn, run_id, [Event("sample_requeued", sample=s, instance=i, data={"why": why}) for s, i in sorted(rows)]
    )
    return sorted(s for s, _ in rows)
