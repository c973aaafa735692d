"""Reward side of the protocol: claiming finished samples, recording rewards, which places each
group that now has N rewarded members (Occupy) or filters it (DAPO, re-enqueued), and dropping
the claimed samples a reward worker gives up on (`drop_rewards`), fenced by the claim."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, NamedTuple, cast

from sqlalchemy import Connection

from workers.wire.enums import DropReason, GroupState
from workers.wire.packed import PACKED_TOKEN_IDS

from .. import payloads, queries
from ..errors import Conflict, InvalidInput, NotFound
from ..idempotency import transactional
from ..rules import occupy_plan, replacement_key
from ..types import GroupOutcome
from . import driver
from .core import (
    FAST_KEEP,
    FAST_UNDONE,
    LockedRead,
    Prompt,
    RunTx,
    TxMixin,
    abort_samples_where,
    check_batch,
    enqueue_prompts,
    if_fast,
    load_run,
    lock_fast_or_run,
)
from .events import Event

# why a reward worker may give up on a claimed sample (drop_rewards)
REWARD_DROP_REASONS = (DropReason.REWARD_FAILED,)


@dataclass
class RewardTask:
    sample_id: int
    reward_attempt: int
    group_id: int
    prompt_tokens: Annotated[list[int], PACKED_TOKEN_IDS]
    # the stored bytes (workers.wire.packed.PackedArray), as TrainSample's tokens: a sequence of
    # their values, serialised packed as they are (context {"packed": True}) or as a list
    response_tokens: Annotated[Sequence[int], PACKED_TOKEN_IDS]
    finish_reason: str | None
    meta: dict[str, Any] = field(default_factory=dict)
    response_mask: list[int] = field(default_factory=list)  # per response token: 1 generated, 0 observed


class RewardedGroup(NamedTuple):
    """A group of the reward batch as `rewards_read` reads it (FOR UPDATE)."""

    id: int
    state: str
    client_key: str
    prompt_tokens: list[int]
    meta: dict[str, Any]


class Member(NamedTuple):
    """A member of such a group, as the batch's own update leaves it."""

    group_id: int
    id: int
    idx: int
    state: str
    v_traj: int | None
    reward: float | None


class ScoringOps(TxMixin):
    @transactional
    def claim_idle(self, run_id: int, request_id: str | None = None, *, conn: Connection | None = None) -> bool:
        """True when a claim in the run (sent with `request_id`) would now only answer empty:
        nothing finished, no claim expired, no outcome stored under the request id (an unknown
        run is not idle: its claim raises). One read, no lock and no write: a claim long-poll's
        re-checks run it in autocommit, one round trip instead of a transaction of four; a
        woken claim that another reward worker beat to the samples costs that read alone."""
        with self.statement_tx(conn) as conn:
            return bool(conn.execute(queries.text("claim_idle"), {"run": run_id, "k": request_id}).scalar())

    def claim_rewards(
        self, run_id: int, limit: int = 100, claim_seconds: float = 60.0, *, conn: Connection | None = None
    ) -> list[RewardTask]:
        """Claim finished samples for a reward worker (expired claims become claimable again)."""
        if not 1 <= limit <= 10_000:
            raise InvalidInput("limit must be in 1..10000")
        with self.tx(conn) as conn:
            # Lock expired claims in id order and skip rows another transaction holds (a
            # record_rewards posting late, under the run lock): scan-order locking here
            # deadlocked with it. A skipped row is reset by a later claim if still expired.
            conn.execute(queries.text("claim_reset_expired"), {"run": run_id})
            rows = conn.execute(
                queries.text("claim_rewards"),
                {"run": run_id, "n": limit, "ttl": claim_seconds},
            ).all()
            if not rows:  # only then ask whether the run exists: one round trip less per claim
                load_run(conn, run_id, lock=False)
            return [
                RewardTask(
                    r.id,
                    r.reward_attempt,
                    r.group_id,
                    list(r.prompt_tokens),
                    payloads.packed_tokens(r.response or b""),
                    r.finish_reason,
                    r.meta,
                    payloads.per_token(r.lengths, [int(g) for g in r.generated or ()]),
                )
                for r in rows
            ]

    @transactional
    def record_rewards(
        self,
        run_id: int,
        rewards: Sequence[Reward],
        request_id: str | None = None,
        *,
        scorer: int | None = None,
        conn: Connection | None = None,
    ) -> list[GroupOutcome]:
        """Store rewards, fenced by the claim attempt; groups that reach N rewarded members are
        placed (Occupy) or filtered. All or nothing. Each reward is (sample, attempt, reward) or
        (sample, attempt, reward, metrics): metrics a {name: finite number} kept with it.
        `scorer` is the API token posting them (the lineage's "who scored it"; None in-process)."""
        check_batch(rewards, "rewards")
        read = rewards_read(rewards, scorer)

        def record(conn: Connection) -> list[GroupOutcome]:
            check = (if_fast("rewards_fast_check"), read.statement(run_id)[1])
            locked = lock_fast_or_run(conn, run_id, "rewards_fast_check", read, [check])
            if locked.rtx is None:
                if rewards_fast(conn, run_id, read, *locked.fast):
                    return []  # no group completed: no Occupy, no buffer accounting
                # a group completes after all: the group locks are freed before the run lock is awaited
                locked = lock_fast_or_run(conn, run_id, "rewards_fast_check", read, fast=False, prelude=FAST_UNDONE)
            assert locked.rtx is not None
            outcomes = rewards_in(locked.rtx, rewards, read)
            locked.rtx.flush()
            return outcomes

        outcomes: list[GroupOutcome] = self.idempotent(
            request_id,
            "reward",
            record,
            lambda stored: [GroupOutcome(**{**o, "state": GroupState(o["state"])}) for o in stored],
            body=[run_id, rewards],
            conn=conn,
        )
        return outcomes

    @transactional
    def drop_rewards(
        self,
        run_id: int,
        drops: Sequence[tuple[int, int]],
        reason: DropReason = DropReason.REWARD_FAILED,
        *,
        conn: Connection | None = None,
    ) -> list[int]:
        """A reward worker gives up on samples it claimed (`drops`: (sample, claim attempt)):
        they are aborted with `reason`, fenced by the claim like a reward, all or nothing; a
        group that can no longer reach N live members is aborted too (insufficient_members).
        A sample already dropped at that attempt with that reason is skipped (a retry). Returns
        the samples aborted now. Only reasons a reward worker can know are taken: the others
        (surplus, window_closed …) are the protocol's own findings, and the audit trusts them."""
        if DropReason(reason) not in REWARD_DROP_REASONS:
            allowed = ", ".join(r.value for r in REWARD_DROP_REASONS)
            raise InvalidInput(f"a reward worker drops samples with reason {allowed}, not {DropReason(reason).value}")
        check_batch(drops, "samples")
        ids = [d[0] for d in drops]
        if len(set(ids)) != len(ids):
            raise InvalidInput("a sample appears twice in one drop batch")
        reason_value = getattr(reason, "value", reason)
        with self.run_tx(run_id, conn) as rtx:
            rows = rtx.conn.execute(queries.text("reward_drop_candidates"), {"run": run_id, "ids": ids}).all()
            info = {r.id: r for r in rows}
            chosen, conflicts = [], []
            for sid, attempt in drops:
                s = info.get(sid)
                if s is None:
                    raise NotFound(f"sample {sid} in run {run_id}")
                if s.reward_attempt == attempt and s.state == "aborted" and s.reason == reason_value:
                    continue  # dropped by this very claim already
                if s.state != "scoring" or s.reward_attempt != attempt:
                    conflicts.append((sid, "reward claim lost (stale attempt or sample not scoring)"))
                else:
                    chosen.append(sid)
            if conflicts:
                raise Conflict(conflicts)
            gids = sorted({info[sid].group_id for sid in chosen if info[sid].group_state in ("queued", "reserved")})
            live: defaultdict[int, int] = defaultdict(int)
            for gid, n in rtx.conn.execute(queries.text("live_members"), {"g": gids}).all():
                live[gid] = n
            doomed = []
            for sid in chosen:  # as abort_samples: a group short of N live members is dropped
                gid = info[sid].group_id
                live[gid] -= 1
                if gid in gids and gid not in doomed and live[gid] < rtx.run.group_size:
                    doomed.append(gid)
            aborted = abort_samples_where(rtx.conn, run_id, "id", chosen, reason_value, rtx.events)
            rtx.drop_groups(doomed, "aborted", DropReason.INSUFFICIENT_MEMBERS)
            return sorted(aborted)


# A batch that completes no reserved group (none reaches N rewarded members with it) goes
# without the run lock: `rewards_fast`, under the groups' group locks (core.py, "group locks").


def rewards_fast(conn: Connection, run_id: int, read: LockedRead, fast: bool | None) -> bool:
    """Record the batch without the run lock if `fast`, the result of `rewards_fast_check` sent
    under the groups' group locks (`lock_fast_or_run`), says it completes no group and every
    claim holds: True when recorded; False: nothing was done, the call needs the run lock. A
    claim lost after the check is refused as under the lock (`Conflict`, nothing stored)."""
    if not fast:
        return False
    # released before the writes: they then belong to the transaction, not a subtransaction
    _, held = driver.scalars(conn, [FAST_KEEP, read.statement(run_id, "rewards_store")])
    holds = dict(held)
    conflicts = [(sid, LOST_CLAIM) for sid in read.params["samples"] if not holds.get(sid)]
    if conflicts:
        raise Conflict(conflicts)
    return True


LOST_CLAIM = "reward claim lost (stale attempt or sample not scoring)"


# ONE statement (`rewards_read` in scoring.sql), sent with the run lock (`lock_fast_or_run`; under it
# every round trip counts): lock the batch's samples, check every claim and store the rewards
# only if all hold (all or nothing, even if a caller's transaction went on after the Conflict),
# then lock their groups and read the members. Lock order run -> group locks -> samples ->
# groups, each in id order: UNION ALL branches run one after the other. The members come from
# the statement's snapshot (taken after the run lock and the groups' group locks were
# granted), so the batch's own rows are seen as before this update and patched below; any
# other reward of these groups was committed before we took their group locks (every reward
# is recorded under them), so the snapshot has it. The groups by
# `= ANY(ARRAY(...))`: index lookups, not the scan of all groups `IN (SELECT ...)` got; so are
# the samples (`x.id = ANY(:samples)`, each one's attempt and reward by its position: joined to
# unnest() they were planned as a scan of every sample, or a nested loop over the batch per
# sample) and the groups' members.


Reward = tuple[int, int, float] | tuple[int, int, float, "dict[str, float] | None"]
"""(sample, claim attempt, reward) or with the reward's metrics as a fourth element."""

MAX_METRICS = 64


def reward_metrics(sid: int, reward: Sequence[Any]) -> dict[str, float] | None:
    """The reward's metrics checked: at most MAX_METRICS names (1..200 characters, no NUL),
    each a finite number."""
    return checked_metrics(f"sample {sid}", reward[3] if len(reward) > 3 else None)


def checked_metrics(what: str, metrics: Any) -> dict[str, float] | None:
    """Metrics (a reward's, a trained step's) checked: at most MAX_METRICS names (1..200
    characters, no NUL), each a finite number; `what` names their owner in a refusal."""
    if metrics is None:
        return None
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        raise InvalidInput(f"{what}: metrics must be an object of at most {MAX_METRICS} numbers")
    for k, v in metrics.items():
        if not isinstance(k, str) or not 1 <= len(k) <= 200 or "\x00" in k:
            raise InvalidInput(f"{what}: a metric name must be 1..200 characters without NUL")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > 1e300:
            raise InvalidInput(f"{what}: metric {k!r} must be a finite number")
    return {k: float(v) for k, v in metrics.items()}


def rewards_read(rewards: Sequence[Reward], scorer: int | None = None) -> LockedRead:
    """The read of `rewards_in`, which stores the rewards: so the batch is checked first,
    before the lock (a caller's transaction may go on after the refusal)."""
    ids = [r[0] for r in rewards]
    if len(set(ids)) != len(ids):
        raise InvalidInput("a sample appears twice in one reward batch")
    metrics = []
    for r in rewards:
        sid, reward = r[0], r[2]
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise InvalidInput(f"sample {sid}: reward must be a finite number")
        m = reward_metrics(sid, r)
        metrics.append(None if m is None else json.dumps(m))
    return LockedRead(
        "rewards_read",
        {
            "samples": ids,
            "attempts": [r[1] for r in rewards],
            "rewards": [float(r[2]) for r in rewards],
            "metrics": metrics,
            "scorer": [scorer],  # a locked read's parameters are lists
        },
        locks=("group_locks",),
    )


def rewards_in(rtx: RunTx, rewards: Sequence[Reward], read: LockedRead) -> list[GroupOutcome]:
    """Record a batch checked by `rewards_read`, whose result `lock_fast_or_run` sent with the lock."""
    run = rtx.run
    got: dict[str, list[dict[str, Any]]] = {"s": [], "g": [], "m": [], "r": []}
    for kind, row in rtx.locked_read(read):
        got[kind].append(row)
    rows = {r["id"]: r for r in got["s"]}
    # the run's reservations, for Occupy's plan: the batch's own update changes no member's
    # state to or from queued or aborted, so the pre-update snapshot gives the same versions
    rtx.set_reservations([(r["id"], r["b"], r["v"]) for r in got["r"]])
    conflicts = []
    for sid, *_ in rewards:
        if sid not in rows:
            raise NotFound(f"sample {sid} in run {run.id}")
        if not rows[sid]["holds"]:
            conflicts.append((sid, LOST_CLAIM))
    if conflicts:
        raise Conflict(conflicts)
    rtx.events.extend(Event("sample_rewarded", sample=r[0], data={"reward": float(r[2])}) for r in rewards)
    mine = {r[0]: float(r[2]) for r in rewards}
    members: defaultdict[int, list[Member]] = defaultdict(list)
    for m in sorted(got["m"], key=lambda m: (m["group_id"], m["idx"])):
        if m["id"] in mine:  # as this statement's update left it
            m = {**m, "state": "rewarded", "reward": mine[m["id"]]}
        members[m["group_id"]].append(Member(**m))
    groups = {g["id"]: RewardedGroup(**g) for g in got["g"]}
    return occupy_ready_groups(rtx, sorted(groups), groups, members)


def occupy_ready_groups(
    rtx: RunTx, group_ids: list[int], groups: dict[int, RewardedGroup], members: dict[int, list[Member]]
) -> list[GroupOutcome]:
    """Occupy (or filter) each reserved group that now has N rewarded members; `groups` are
    locked, `members` in idx order."""
    conn, run = rtx.conn, rtx.run
    outcomes, occupied = [], []
    for gid in group_ids:
        g = groups[gid]
        rewarded = [m for m in members[gid] if m.state == "rewarded"]
        if g.state != "reserved" or len(rewarded) < run.group_size:
            continue
        chosen = rewarded[: run.group_size]
        # Release, place this group, and only then let other reservations move into the slot
        # it freed: a cascade run first could take the very slot this group needs.
        freed = rtx.unreserve(gid)
        if run.dapo_filter and len({m.reward for m in chosen}) == 1:
            rtx.drop_groups([gid], "filtered", DropReason.FILTERED)
            rtx.cascade(freed)
            (replacement,) = enqueue_prompts(
                conn, run, [Prompt(replacement_key(g.client_key), list(g.prompt_tokens), g.meta)], replacement_of=[gid]
            )
            outcomes.append(GroupOutcome(gid, GroupState.FILTERED, replacement=replacement))
            continue
        version = min(cast(int, m.v_traj) for m in chosen)  # rewarded, so routed: it has a V_traj
        b, moves = occupy_plan(freed, rtx.buffers, rtx.reservations().values(), version, run.version, run.limits)
        if b is None:
            rtx.drop_groups([gid], "aborted", DropReason.NO_BUFFER)
            rtx.cascade(freed)
            outcomes.append(GroupOutcome(gid, GroupState.ABORTED, reason=DropReason.NO_BUFFER.value))
            continue
        rtx.apply_moves(moves)
        rtx.buffer(b).occupied += 1
        occupied.append((gid, b, version))
        rtx.events.append(Event("group_occupied", group=gid, buffer=b, data={"version": version}))
        chosen_ids = {m.id for m in chosen}
        surplus = [m.id for m in members[gid] if m.id not in chosen_ids and m.state != "aborted"]
        abort_samples_where(conn, run.id, "id", surplus, DropReason.SURPLUS.value, rtx.events)
        if not moves and b != freed:  # it landed earlier on its own: the slot it held is free now
            rtx.cascade(freed)
        outcomes.append(GroupOutcome(gid, GroupState.OCCUPIED, buffer=b))
    if occupied:  # sent with the flush, not on a round trip of its own: this runs under the run lock
        rtx.defer(
            "occupy_groups",
            {"ids": [o[0] for o in occupied], "bs": [o[1] for o in occupied], "vs": [o[2] for o in occupied]},
            groups=[o[0] for o in occupied],
        )
    return outcomes
