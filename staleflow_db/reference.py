"""The staleness protocol in memory: no database, no I/O.

It is the oracle of the model-based tests (the PostgreSQL implementation must agree with it
operation by operation) and the protocol engine of the discrete-event simulator. Operations
and outcomes mirror `staleflow_db.protocol`; refusals raise the same exceptions and change
nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from workers.wire.enums import DropReason, GroupState, InstanceState, SampleState, SegmentKind
from workers.wire.types import RouteOutcome

from .errors import Conflict, InvalidInput, NotFound
from .rules import (
    BufferCounts,
    Limits,
    Reservation,
    apply_moves,
    cascade_moves,
    group_version,
    occupy_plan,
    replacement_key,
    reserve_target,
    route_decision,
    window_has_room,
)
from .types import GroupOutcome, Report, RouteResult, RunConfig, check_config


@dataclass
class RefSegment:
    version: int
    instance_id: int
    tokens: list[int]
    logprobs: list[float]


@dataclass
class RefSample:
    id: int
    group_id: int
    idx: int
    state: SampleState = SampleState.QUEUED
    v_traj: int | None = None
    attempt: int = 0
    route_token: str | None = None  # secret token of the latest route
    instance_id: int | None = None
    segments: list[RefSegment] = field(default_factory=list)
    reward: float | None = None
    reward_attempt: int = 0
    reason: str | None = None

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)


@dataclass
class RefGroup:
    id: int
    client_key: str
    prompt: list[int]
    sample_ids: list[int]
    state: GroupState = GroupState.QUEUED
    reserved_buffer: int | None = None
    min_version: int | None = None  # the live group version right after its latest route
    live_version: int | None = None  # the live group version now (`rules.group_version`)
    buffer: int | None = None  # where it was occupied
    group_version: int | None = None
    reason: str | None = None
    replacement_of: int | None = None


@dataclass
class RefInstance:
    id: int
    version: int
    state: InstanceState = InstanceState.ACTIVE


class ReferenceProtocol:
    def __init__(self, config: RunConfig):
        check_config(config)
        self.config = config
        assert config.buffer_capacity is not None and config.samples_per_group is not None  # __post_init__
        self.limits: Limits = config
        self.samples_per_group = config.samples_per_group
        self.version = 0
        self.groups: dict[int, RefGroup] = {}
        self.samples: dict[int, RefSample] = {}
        self.instances: dict[int, RefInstance] = {}
        self.buffers: dict[int, BufferCounts] = {}
        self.keys: dict[str, int] = {}
        self.consume_fence: dict[int, int] = {}  # buffer -> consume fence of the latest consume
        self.published: dict[int, dict[str, Any]] = {}  # version -> parameter metadata
        self.reserved: dict[int, RefGroup] = {}  # groups holding a reservation, by id
        self._finished: set[int] = set()  # samples that became FINISHED (claims scan only these)

    # ---- prompts and instances -------------------------------------------------------------

    def enqueue(self, client_key: str, prompt: list[int], replacement_of: int | None = None) -> int:
        if replacement_of is None and client_key.startswith("~"):
            raise InvalidInput(f"client_key {client_key!r}: keys starting with '~' are reserved for replacements")
        if client_key in self.keys:
            return self.keys[client_key]
        if not prompt or len(prompt) > self.config.max_prompt_tokens:
            raise InvalidInput(f"prompt of {len(prompt)} tokens (allowed 1..{self.config.max_prompt_tokens})")
        gid = len(self.groups) + 1
        first = len(self.samples) + 1
        ids = list(range(first, first + self.samples_per_group))
        self.groups[gid] = RefGroup(gid, client_key, list(prompt), ids, replacement_of=replacement_of)
        for i, sid in enumerate(ids):
            self.samples[sid] = RefSample(sid, gid, i)
        self.keys[client_key] = gid
        return gid

    def register_instance(self, version: int) -> int:
        if not 0 <= version <= self.version:
            raise InvalidInput(f"instance version {version} outside 0..{self.version}")
        iid = len(self.instances) + 1
        self.instances[iid] = RefInstance(iid, version)
        return iid

    def heartbeat(self, instance_id: int, version: int) -> None:
        inst = self._instance(instance_id)
        if inst.state != InstanceState.ACTIVE:
            raise Conflict([(instance_id, f"instance is {inst.state.value}")])
        if not inst.version <= version <= self.version:
            raise InvalidInput(f"instance version {version} outside {inst.version}..{self.version}")
        inst.version = version

    def expire_instance(self, instance_id: int) -> list[int]:
        """Fence the instance and requeue its running samples with the tokens they reported."""
        inst = self._instance(instance_id)
        if inst.state != InstanceState.ACTIVE:
            return []
        inst.state = InstanceState.EXPIRED
        requeued = []
        for s in self.samples.values():
            if s.state == SampleState.RUNNING and s.instance_id == instance_id:
                s.state, s.instance_id = SampleState.QUEUED, None
                requeued.append(s.id)
                if s.n_tokens == 0:
                    self._refresh_version(self.groups[s.group_id])
        return requeued

    # ---- route (Reserve) -------------------------------------------------------------------

    def route(self, pairs: Iterable[tuple[int, int]]) -> list[RouteResult]:
        pairs = list(pairs)
        for sid, iid in pairs:  # unknown ids refuse the whole batch before anything changes
            if sid not in self.samples:
                raise NotFound(f"sample {sid}")
            if iid not in self.instances:
                raise NotFound(f"instance {iid}")
        return [self._route_one(sid, iid) for sid, iid in pairs]

    def _route_one(self, sample_id: int, instance_id: int) -> RouteResult:
        s, inst = self.samples[sample_id], self.instances[instance_id]
        if s.state != SampleState.QUEUED:
            return RouteResult(sample_id, RouteOutcome.NOT_QUEUED)
        if inst.state != InstanceState.ACTIVE:
            return RouteResult(sample_id, RouteOutcome.INSTANCE_INACTIVE)
        g = self.groups[s.group_id]
        if g.state not in (GroupState.QUEUED, GroupState.RESERVED):
            return RouteResult(sample_id, RouteOutcome.GROUP_CLOSED)
        last = s.segments[-1].version if s.segments else None
        outcome, v, b = route_decision(
            s.n_tokens > 0, s.v_traj, last, inst.version, g.reserved_buffer, self.buffers, self.version, self.limits
        )
        if outcome != RouteOutcome.ROUTED:
            return RouteResult(sample_id, RouteOutcome(outcome))
        if b is not None:
            self.buffers.setdefault(b, BufferCounts(b)).reserved += 1
            g.state, g.reserved_buffer = GroupState.RESERVED, b
            self.reserved[g.id] = g
        s.v_traj, s.state, s.instance_id = v, SampleState.RUNNING, instance_id
        s.attempt += 1
        s.route_token = str(uuid.uuid4())
        self._refresh_version(g)
        g.min_version = g.live_version
        return RouteResult(sample_id, RouteOutcome.ROUTED, s.attempt, v, g.reserved_buffer, s.route_token)

    # ---- segments --------------------------------------------------------------------------

    def report(self, reports: list[Report]) -> None:
        """All-or-nothing: a lost route or bad input anywhere refuses the whole batch."""
        conflicts, pending = [], {}
        for r in reports:
            s = self.samples.get(r.sample_id)
            if s is None:
                raise NotFound(f"sample {r.sample_id}")
            self._instance(r.instance_id)
            r.check_shape()
            if r.sample_id in pending:
                raise InvalidInput(f"sample {r.sample_id} appears twice in one report batch")
            # fenced by the reporting instance, the attempt and the secret route token
            if s.state != SampleState.RUNNING or (s.instance_id, s.attempt, s.route_token) != (
                r.instance_id,
                r.attempt,
                r.route_token,
            ):
                conflicts.append(
                    (r.sample_id, "route lost (not running, another instance's, stale attempt or route token)")
                )
                continue
            assert s.v_traj is not None  # running: routed at a version
            if r.version is None:  # the model covers single-turn trajectories (no observations)
                raise InvalidInput(f"sample {r.sample_id}: the reference model has no observations")
            last = s.segments[-1].version if s.segments else s.v_traj
            if not (max(last, s.v_traj) <= r.version <= self.version):
                raise InvalidInput(f"sample {r.sample_id}: segment version {r.version} outside {last}..{self.version}")
            if s.n_tokens + len(r.tokens) > self.config.max_response_tokens:
                raise InvalidInput(f"sample {r.sample_id}: response over {self.config.max_response_tokens} tokens")
            pending[r.sample_id] = r
        if conflicts:
            raise Conflict(conflicts)
        for r in reports:
            s = self.samples[r.sample_id]
            if r.tokens:
                assert s.instance_id is not None and r.version is not None  # running; generated (above)
                s.segments.append(RefSegment(r.version, s.instance_id, list(r.tokens), list(r.logprobs)))
            if r.kind == SegmentKind.FINISHED:
                s.state = SampleState.FINISHED
                self._finished.add(s.id)
            elif r.kind == SegmentKind.INTERRUPTED:
                s.state, s.instance_id = SampleState.QUEUED, None
                if s.n_tokens == 0:  # back in the queue with no trajectory: no longer pins a version
                    self._refresh_version(self.groups[s.group_id])

    # ---- reward and Occupy -----------------------------------------------------------------

    def claim_rewards(self, limit: int) -> list[tuple[int, int]]:
        ready = sorted(i for i in self._finished if self.samples[i].state == SampleState.FINISHED)
        claimed = []
        for sid in ready[:limit]:
            s = self.samples[sid]
            s.state = SampleState.SCORING
            s.reward_attempt += 1
            claimed.append((sid, s.reward_attempt))
        self._finished = set(ready[limit:])
        return claimed

    def release_reward_claims(self, sample_ids: Iterable[int]) -> None:
        """A reward claim that expired: the sample is claimable again."""
        for sid in sample_ids:
            if self.samples[sid].state == SampleState.SCORING:
                self.samples[sid].state = SampleState.FINISHED
                self._finished.add(sid)

    def record_rewards(self, rewards: list[tuple[int, int, float]]) -> list[GroupOutcome]:
        conflicts = []
        for sid, attempt, _ in rewards:
            s = self.samples.get(sid)
            if s is None:
                raise NotFound(f"sample {sid}")
            if s.state != SampleState.SCORING or s.reward_attempt != attempt:
                conflicts.append((sid, "reward claim lost (stale attempt or sample not scoring)"))
        if len({sid for sid, _, _ in rewards}) != len(rewards):
            raise InvalidInput("a sample appears twice in one reward batch")
        if conflicts:
            raise Conflict(conflicts)
        for sid, _, reward in rewards:
            s = self.samples[sid]
            s.state, s.reward = SampleState.REWARDED, float(reward)
        touched = sorted({self.samples[sid].group_id for sid, _, _ in rewards})
        return [o for o in (self._maybe_occupy(self.groups[gid]) for gid in touched) if o]

    def _maybe_occupy(self, g: RefGroup) -> GroupOutcome | None:
        if g.state != GroupState.RESERVED:
            return None
        rewarded = [self.samples[i] for i in g.sample_ids if self.samples[i].state == SampleState.REWARDED]
        if len(rewarded) < self.config.group_size:
            return None
        chosen = rewarded[: self.config.group_size]
        chosen_ids = {s.id for s in chosen}
        # Release, place this group, and only then let other reservations move into the slot
        # it freed: a cascade run first could take the very slot this group needs.
        freed = self._unreserve(g)
        if self.config.dapo_filter and len({s.reward for s in chosen}) == 1:
            self._drop_group(g, GroupState.FILTERED, DropReason.FILTERED)
            self._cascade(freed)
            replacement = self.enqueue(replacement_key(g.client_key), g.prompt, replacement_of=g.id)
            return GroupOutcome(g.id, GroupState.FILTERED, replacement=replacement)
        version = min(v for v in (s.v_traj for s in chosen) if v is not None)  # rewarded: all routed
        b, moves = occupy_plan(freed, self.buffers, self._reservations(), version, self.version, self.limits)
        if b is None:
            self._drop_group(g, GroupState.ABORTED, DropReason.NO_BUFFER)
            self._cascade(freed)
            return GroupOutcome(g.id, GroupState.ABORTED, reason=DropReason.NO_BUFFER.value)
        self._apply(moves)
        self.buffers.setdefault(b, BufferCounts(b)).occupied += 1
        g.state, g.buffer, g.group_version = GroupState.OCCUPIED, b, version
        for i in g.sample_ids:
            if i not in chosen_ids:
                self._abort_sample(self.samples[i], DropReason.SURPLUS.value)
        if not moves and b != freed:  # it landed earlier on its own: the slot it held is free now
            self._cascade(freed)
        return GroupOutcome(g.id, GroupState.OCCUPIED, buffer=b)

    # ---- release, abort --------------------------------------------------------------------

    def _release(self, g: RefGroup) -> None:
        """Give back the group's reservation, then let earlier reservations move later."""
        self._cascade(self._unreserve(g))

    def _unreserve(self, g: RefGroup) -> int:
        b = g.reserved_buffer
        assert b is not None  # a reserved group
        self.buffers[b].reserved -= 1
        g.reserved_buffer = None
        del self.reserved[g.id]
        return b

    def _reservations(self) -> list[Reservation]:
        return [
            Reservation(o.id, o.reserved_buffer, o.live_version)
            for o in self.reserved.values()
            if o.reserved_buffer is not None  # all of them: reserved groups hold a buffer
        ]

    def _cascade(self, freed: int) -> None:
        for gid, _, to in cascade_moves(freed, self.buffers, self._reservations(), self.limits):
            self.groups[gid].reserved_buffer = to

    def _apply(self, moves: list[tuple[int, int, int]]) -> None:
        apply_moves(self.buffers, moves)
        for gid, _, to in moves:
            self.groups[gid].reserved_buffer = to

    def _refresh_version(self, g: RefGroup) -> None:
        g.live_version = group_version(
            (m.state.value, m.v_traj, m.n_tokens) for m in (self.samples[i] for i in g.sample_ids)
        )

    def group_version(self, group_id: int) -> int | None:
        """The live group version of a group (None while no member pins one)."""
        return self.groups[group_id].live_version

    def _abort_sample(self, s: RefSample, reason: str) -> None:
        if s.state not in (SampleState.ABORTED,):
            s.state, s.reason, s.instance_id = SampleState.ABORTED, reason, None
            g = self.groups[s.group_id]
            if g.state == GroupState.RESERVED:  # its window may widen
                self._refresh_version(g)

    def _drop_group(self, g: RefGroup, state: GroupState, reason: DropReason) -> None:
        g.state, g.reason = state, reason.value
        for i in g.sample_ids:
            self._abort_sample(self.samples[i], reason.value)

    def abort_group(self, group_id: int, reason: DropReason = DropReason.USER) -> bool:
        g = self.groups.get(group_id)
        if g is None:
            raise NotFound(f"group {group_id}")
        if g.state not in (GroupState.QUEUED, GroupState.RESERVED):
            return False
        if g.state == GroupState.RESERVED:
            self._release(g)
        self._drop_group(g, GroupState.ABORTED, reason)
        return True

    def abort_samples(self, sample_ids: Iterable[int], reason: DropReason = DropReason.USER) -> list[int]:
        """Abort members; a group that can no longer reach N live members is aborted too."""
        sample_ids = list(sample_ids)
        if len(set(sample_ids)) != len(sample_ids):
            raise InvalidInput("a sample appears twice in one abort batch")
        aborted = []
        for sid in sample_ids:
            s = self.samples.get(sid)
            if s is None:
                raise NotFound(f"sample {sid}")
            g = self.groups[s.group_id]
            if s.state == SampleState.ABORTED or g.state not in (GroupState.QUEUED, GroupState.RESERVED):
                continue
            self._abort_sample(s, reason.value)
            aborted.append(sid)
            live = sum(self.samples[i].state != SampleState.ABORTED for i in g.sample_ids)
            if live < self.config.group_size:
                self.abort_group(g.id, DropReason.INSUFFICIENT_MEMBERS)
        return aborted

    def abort_after_ready(self) -> list[int]:
        """Reserved groups none of whose window buffers still needs entries can never land."""
        doomed = [
            g.id
            for g in sorted(self.reserved.values(), key=lambda g: g.id)
            if g.live_version is not None
            and not window_has_room(self.buffers, g.live_version, self.version, self.limits)
        ]
        for gid in doomed:
            self.abort_group(gid, DropReason.WINDOW_READY)
        return doomed

    # ---- Consume and publish ---------------------------------------------------------------

    def consume(self, version: int) -> tuple[int, list[int]] | None:
        """Fence the ready buffer at the run's version: (consume fence, group ids) or None."""
        if version != self.version:
            raise Conflict([(version, f"run is at version {self.version}")])
        buf = self.buffers.get(version)
        if buf is None or buf.occupied < self.config.batch_size:
            return None
        fence = self.consume_fence.get(version, 0) + 1
        self.consume_fence[version] = fence
        groups = sorted(g.id for g in self.groups.values() if g.state == GroupState.OCCUPIED and g.buffer == version)
        return fence, groups

    def publish(self, version: int, consume_fence: int, params: dict[str, Any] | None = None) -> int:
        """Buffer `version` consumed and the run at `version + 1`, atomically; idempotent."""
        if version == self.version - 1 and version in self.published:
            # A retry only under the consume fence that published, with the same checksum if given.
            if self.consume_fence.get(version) != consume_fence:
                raise Conflict([(version, f"fenced: another trainer published version {self.version}")])
            sent = (params or {}).get("checksum")
            if sent is not None and self.published[version].get("checksum") != sent:
                raise Conflict([(version, "published with another checksum")])
            return self.version
        if version < self.version:
            raise Conflict([(version, f"replay of an older version: run is at version {self.version}")])
        if version != self.version:
            raise Conflict([(version, f"run is at version {self.version}")])
        if self.consume_fence.get(version) != consume_fence:
            raise Conflict([(version, "consume fence lost (another trainer consumed this buffer)")])
        buf = self.buffers[version]
        buf.consumed = True
        for g in self.groups.values():
            if g.state == GroupState.OCCUPIED and g.buffer == version:
                g.state = GroupState.CONSUMED
        self.version += 1
        self.published[version] = dict(params or {})
        # With B' > B a consumed buffer may still hold reservations: move them on or drop them.
        stranded = sorted((g for g in self.reserved.values() if g.reserved_buffer == version), key=lambda g: g.id)
        for g in stranded:
            buf.reserved -= 1
            v = g.live_version if g.live_version is not None else self.version
            b = reserve_target(self.buffers, v, self.version, self.limits)
            if b is None:
                g.reserved_buffer = None
                del self.reserved[g.id]
                self._drop_group(g, GroupState.ABORTED, DropReason.WINDOW_CLOSED)
            else:
                self.buffers.setdefault(b, BufferCounts(b)).reserved += 1
                g.reserved_buffer = b
        return self.version

    # ---- helpers ---------------------------------------------------------------------------

    def _instance(self, instance_id: int) -> RefInstance:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise NotFound(f"instance {instance_id}")
        return inst

    def queued_samples(self) -> list[int]:
        return [s.id for s in self.samples.values() if s.state == SampleState.QUEUED]

    def check_invariants(self) -> list[str]:
        """Every violated invariant of docs/protocol.md, in words; empty when healthy."""
        bad = []
        for b, buf in self.buffers.items():
            groups = [
                g
                for g in self.groups.values()
                if g.buffer == b and g.state in (GroupState.OCCUPIED, GroupState.CONSUMED)
            ]
            reserved = [g for g in self.groups.values() if g.state == GroupState.RESERVED and g.reserved_buffer == b]
            if len(groups) != buf.occupied or len(reserved) != buf.reserved:
                bad.append(
                    f"buffer {b}: counters {buf.occupied}/{buf.reserved} vs entries {len(groups)}/{len(reserved)}"
                )
            if buf.occupied + buf.reserved > self.limits.buffer_capacity:
                bad.append(f"buffer {b} over capacity")
            if buf.consumed and buf.occupied != self.config.batch_size:
                bad.append(f"buffer {b} consumed with {buf.occupied} groups")
            for g in groups:
                if g.group_version is None or not g.group_version <= b <= g.group_version + self.config.eta:
                    bad.append(f"group {g.id} of version {g.group_version} in buffer {b}")
        for s in self.samples.values():
            versions = [seg.version for seg in s.segments]
            if versions and (versions != sorted(versions) or s.v_traj is None or versions[0] < s.v_traj):
                bad.append(f"sample {s.id}: segment versions {versions} with V_traj {s.v_traj}")
            if s.state == SampleState.ABORTED and not s.reason:
                bad.append(f"sample {s.id} aborted without a reason")
        if sorted(b for b, buf in self.buffers.items() if buf.consumed) != list(range(self.version)):
            bad.append(f"consumed buffers are not exactly 0..{self.version - 1}")
        return bad
