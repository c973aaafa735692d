"""Discrete-event simulator of disaggregated RL post-training, in virtual time.

Pieces (none sleeps, none touches a database):

* the protocol — `SimProtocol`, i.e. `staleflow_db.reference.ReferenceProtocol`: every route
  (Reserve), segment report, reward (Occupy), consume and publish goes through it, so the
  simulated runs obey exactly the rules the real system does;
* rollout instances — `SimInstance`, continuous batching on the cost-model clock;
* a trainer — consumes the ready buffer of its version, trains for a tokens-proportional
  time, publishes (the PS then holds the new version);
* the coordinator — every `policy.cycle_period` (100 ms) of virtual time: instance
  heartbeats feed the `SpeculativeState`, `Policy.plan` (the same pure strategy functions the
  real coordinator runs) decides routes, pulls and interrupts, and they are applied.

Time advances in coordinator ticks. A tick in which nothing discrete happened (no finish,
no command, no publish, no pull done) and after which nothing can change until the next
engine event is skipped: the loop jumps to the tick of the next event (finishes, pull ends,
trainer done, a heartbeat that confirms an unconfirmed estimate) or at most `idle_cycle`
seconds ahead. Engines jump between their own events in closed form, so the cost of a run is
the number of events, not the number of tokens.

Simplifications, all policy-neutral: rewards are instantaneous (one reward worker that
never lags), commands reach engines instantly (snapshot lag is modelled by the heartbeat
period instead), a segment is reported to the protocol as one placeholder token (the
protocol's decisions depend on whether a sample has tokens, not on how many; the real
counts live in the `SampleTable`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from staleflow_db.enums import GroupState, SampleState, SegmentKind
from staleflow_db.types import Report, RouteOutcome, RunConfig
from workers.coordinator.policies import Policy, get_policy
from workers.coordinator.state import QueuedSample, SpeculativeState
from workers.coordinator.strategies import AdmissionView

from .engine import SampleTable, SimInstance
from .protocol import SimProtocol
from .setups import Setup, get_setup
from .workload import Workload

_ONE = [0]
_ONE_LP = [0.0]


@dataclass
class SimResult:
    setup: str
    policy: str
    eta: int  # the bound the protocol enforced (sync: 0, one_step: 1)
    steps: int  # training steps completed
    seed: int
    completed: bool
    virtual_time: float  # seconds of simulated time at the last publish
    wall_time: float  # seconds of real time the simulation took
    trained_tokens: int  # response tokens of trained samples
    trained_prompt_tokens: int
    trained_samples: int
    trained_groups: int
    tokens_per_s: float  # trained response tokens / virtual time (whole run)
    samples_per_s: float
    steady_tokens_per_s: float  # after `warmup_steps` steps (pipeline filled)
    steady_samples_per_s: float
    warmup_steps: int
    ideal_tokens_per_s: float  # every instance always at its peak T
    ratio_to_ideal: float  # steady tokens/s / ideal
    rollout_idle_fraction: float  # instance-time with nothing to decode or prefill
    rollout_pull_fraction: float  # instance-time spent loading weights
    trainer_idle_fraction: float
    staleness_hist: dict[int, int]  # trained groups by b - V_group
    sample_staleness_hist: dict[int, int]  # trained samples by b - V_traj
    step_times: list[float]  # time between consecutive publishes (the first: from 0)
    train_times: list[float]
    generated_tokens: int  # all decoded tokens (incl. aborted / not yet trained)
    prefill_tokens: int
    commands: dict[str, int]
    cycles: int
    coordinator_wall_s: float  # real seconds spent in Policy.plan
    snapshots: dict[str, int]
    invariant_violations: list[str]
    # per-instance: how often the coordinator's estimate deviated; not-admitted routes
    route_refusals: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_staleness(self) -> float:
        tot = sum(self.staleness_hist.values())
        return sum(k * v for k, v in self.staleness_hist.items()) / tot if tot else 0.0

    def summary(self) -> str:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.staleness_hist.items()))
        return (
            f"{self.setup} {self.policy} eta={self.eta}: {self.steady_tokens_per_s:,.0f} tok/s "
            f"({self.steady_samples_per_s:.2f} samples/s) steady, {self.tokens_per_s:,.0f} tok/s overall, "
            f"{self.ratio_to_ideal:.0%} of ideal, rollout idle {self.rollout_idle_fraction:.0%}, "
            f"pull {self.rollout_pull_fraction:.1%}, staleness [{hist}], {self.steps} steps in "
            f"{self.virtual_time:,.0f}s virtual / {self.wall_time:.1f}s wall"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean_staleness"] = self.mean_staleness
        return d


_IDEAL_CACHE: dict[tuple, float] = {}


def ideal_tokens_per_s(setup: Setup, seed: int = 0) -> float:
    """Every instance always at its peak T: as many samples as fit in its KV cache, each
    holding the workload's token-weighted mean context (prompt + E[L²]/2E[L])."""
    key = (setup, seed)
    if key not in _IDEAL_CACHE:
        st = Workload(setup.workload, seed).stats(groups=1000, n=setup.group_size)
        peak = setup.cost.peak_throughput(st["mean_running_context"], setup.kv_capacity, setup.max_running)
        _IDEAL_CACHE[key] = peak * setup.instances
    return _IDEAL_CACHE[key]


class Simulator:
    def __init__(
        self,
        setup: Setup | str,
        policy: Policy | str,
        eta: int = 2,
        seed: int = 0,
        *,
        buffer_capacity: int | None = None,
        samples_per_group: int | None = None,
        heartbeat_period: float = 1.0,
        quiet_heartbeat: float = 5.0,
        idle_cycle: float = 5.0,
        prefetch_groups: int | None = None,
        snapshot_tolerance: float = 0.0,
        check_every_step: bool = False,
    ):
        self.setup = get_setup(setup)
        self.policy = get_policy(policy)
        self.seed = seed
        self.eta = self.policy.effective_eta(eta)
        su = self.setup
        self.cost = su.cost
        self.workload = Workload(su.workload, seed)
        if su.kv_capacity < su.workload.prompt_max + su.max_response:
            raise ValueError(f"{su.name}: KV capacity {su.kv_capacity} cannot hold one longest sample")
        cfg = RunConfig(
            batch_size=su.batch_size, group_size=su.group_size, eta=self.eta,
            buffer_capacity=buffer_capacity, samples_per_group=samples_per_group,
            max_response_tokens=su.max_response, max_prompt_tokens=su.workload.prompt_max,
        )
        self.p = SimProtocol(cfg)
        self.table = SampleTable()
        self.spec = SpeculativeState(tolerance=snapshot_tolerance)
        self.period = self.policy.cycle_period
        self.heartbeat_period = heartbeat_period
        self.quiet_heartbeat = max(quiet_heartbeat, heartbeat_period)
        self.idle_cycle = max(idle_cycle, self.period)
        self.prefetch = prefetch_groups if prefetch_groups is not None else max(4, su.batch_size // 16)
        self.check_every_step = check_every_step
        self.detail = self.policy.migration
        rng = np.random.default_rng([seed, 7])
        self.engines: dict[int, SimInstance] = {}
        self.next_hb: dict[int, float] = {}
        for _ in range(su.instances):
            iid = self.p.register_instance(0)
            e = SimInstance(
                iid, self.cost, su.kv_capacity, su.max_running, su.prefill_rate, self.table,
                version=0, phi_wait=self.policy.phi,
            )
            self.engines[iid] = e
            self.spec.observe(e.snapshot(0.0, self.detail))
            self.next_hb[iid] = float(rng.uniform(0, heartbeat_period))
        self.queued: dict[int, QueuedSample] = {}  # insertion order = FIFO
        self.fresh_groups: set[int] = set()
        self.group_index = 0
        # trainer
        self.train_until: float | None = None
        self.train_batch: tuple[int, int, list[int]] | None = None  # (version, lease, groups)
        self.train_busy = 0.0
        self.publish_times: list[float] = []
        self.train_times: list[float] = []
        self.step_tokens: list[int] = []
        self.step_samples: list[int] = []
        self.staleness = Counter()
        self.sample_staleness = Counter()
        self.trained_prompt_tokens = 0
        self.commands = Counter()
        self.cycles = 0
        self.coord_wall = 0.0
        self.route_refusals = 0
        self.violations: list[str] = []
        self.now = 0.0

    # ---- the dataset -----------------------------------------------------------------------

    def _top_up(self) -> bool:
        added = False
        while len(self.fresh_groups) < self.prefetch:
            k = self.group_index
            self.group_index += 1
            n_prime = self.p.config.samples_per_group
            draw = self.workload.group(k, n_prime)
            gid = self.p.enqueue(f"g{k}", [1] * draw.prompt_len)
            for j, sid in enumerate(self.p.groups[gid].sample_ids):
                self.table.add(sid, gid, draw.prompt_len, int(draw.lengths[j]))
                self.queued[sid] = QueuedSample(sid, gid, draw.prompt_len, None, 0)
            self.fresh_groups.add(gid)
            added = True
        return added

    # ---- protocol plumbing -----------------------------------------------------------------

    def _segment_report(self, sid: int, kind: SegmentKind) -> Report:
        tbl = self.table
        has = tbl.gen[sid] > tbl.seg0[sid]
        if has:
            tbl.last_version[sid] = tbl.seg_version[sid]
        return Report(
            sid, tbl.attempt[sid], tbl.seg_version[sid], _ONE if has else [], _ONE_LP if has else [], kind
        )

    def _requeue(self, sids: list[int]) -> None:
        """Report interrupted segments; the samples return to the queue with their tokens."""
        if not sids:
            return
        self.p.report([self._segment_report(s, SegmentKind.INTERRUPTED) for s in sids])
        tbl = self.table
        for sid in sids:
            tbl.instance[sid] = 0
            g = tbl.gen[sid]
            self.queued[sid] = QueuedSample(
                sid, tbl.group[sid], tbl.prompt[sid] + g, tbl.v_traj[sid], g, tbl.last_version[sid],
                tbl.ran_on[sid] or None,
            )

    def _drop_aborted(self, group_ids) -> None:
        """Samples the protocol aborted (surplus, dropped groups) leave engines and queue."""
        for gid in group_ids:
            for sid in self.p.groups[gid].sample_ids:
                if self.p.samples[sid].state != SampleState.ABORTED:
                    continue
                self.queued.pop(sid, None)
                iid = self.table.instance[sid]
                if iid:
                    self.engines[iid].interrupt([sid], self.now)
            if self.p.groups[gid].state != GroupState.QUEUED:
                self.fresh_groups.discard(gid)

    def _finish(self, sids: list[int]) -> bool:
        """Report finished samples, reward them (Occupy); True if some group changed state."""
        if not sids:
            return False
        self.p.report([self._segment_report(s, SegmentKind.FINISHED) for s in sids])
        claimed = self.p.claim_rewards(len(self.p._finished))
        outcomes = self.p.record_rewards([(sid, att, 1.0) for sid, att in claimed])
        touched = [o.group_id for o in outcomes]
        if touched and (self.p.config.samples_per_group > self.p.config.group_size or
                        any(o.state != GroupState.OCCUPIED for o in outcomes)):
            self._drop_aborted(touched)
        return bool(outcomes)

    # ---- trainer ---------------------------------------------------------------------------

    def _trainer(self) -> bool:
        changed = False
        p = self.p
        if self.train_until is not None and self.now >= self.train_until - 1e-9:
            v, lease, _ = self.train_batch
            p.publish(v, lease)
            self.publish_times.append(self.now)
            self.train_until = self.train_batch = None
            doomed = p.abort_after_ready()
            if doomed:
                self._drop_aborted(doomed)
            # consumed buffers can strand reservations (B' > B): those groups may be aborted
            stranded = [gid for gid, g in p.groups.items() if g.state == GroupState.ABORTED and gid in self.fresh_groups]
            if stranded:
                self._drop_aborted(stranded)
            if self.check_every_step:
                self.violations.extend(p.check_invariants())
            changed = True
        if self.train_until is None:
            res = p.consume(p.version)
            if res is not None:
                lease, gids = res
                b = p.version
                tokens = prompt_tokens = samples = 0
                tbl = self.table
                for gid in gids:
                    g = p.groups[gid]
                    self.staleness[b - g.group_version] += 1
                    for sid in g.sample_ids:
                        s = p.samples[sid]
                        if s.state == SampleState.REWARDED:
                            tokens += tbl.gen[sid]
                            prompt_tokens += tbl.prompt[sid]
                            samples += 1
                            self.sample_staleness[b - s.v_traj] += 1
                self.step_tokens.append(tokens)
                self.step_samples.append(samples)
                self.trained_prompt_tokens += prompt_tokens
                dt = self.setup.train_step_time(tokens + prompt_tokens)
                self.train_times.append(dt)
                self.train_busy += dt
                self.train_until = self.now + dt
                self.train_batch = (b, lease, gids)
                changed = True
        return changed

    # ---- coordinator -----------------------------------------------------------------------

    def _collect(self, e: SimInstance, finished: list[int], interrupted: list[int]) -> None:
        """Drain an engine's outbox and refresh its next event time."""
        if e.finished:
            finished.extend(e.finished)
            e.finished.clear()
            self.engine_changed.add(e.id)
        if e.interrupted:
            interrupted.extend(e.interrupted)
            e.interrupted.clear()
            self.engine_changed.add(e.id)
        if e.pulled:
            # the worker reports the new version as soon as the weights are loaded: that is a
            # heartbeat, and its snapshot reaches the coordinator at once
            self.p.heartbeat(e.id, e.version)
            e.pulled = False
            self.commands["pull_done"] += 1
            self.pulls_done = True
            if self.spec.observe(e.snapshot(self.now, self.detail)):
                self.engine_changed.discard(e.id)
            else:
                self.engine_changed.add(e.id)
        self.next_ev[e.id] = e.next_event_time()

    def _heartbeats(self, finished: list[int], interrupted: list[int]) -> bool:
        """Snapshots of the engines whose heartbeat is due; True if one changed the picture."""
        now, changed = self.now, False
        for iid, e in self.engines.items():
            if now < self.next_hb[iid]:
                continue
            est = self.spec.estimates[iid]
            if (
                iid not in self.engine_changed
                and est.last_change_at < est.snapshot_at
                and now - est.snapshot_at < self.quiet_heartbeat
            ):
                # nothing discrete happened on this engine since its last accepted snapshot:
                # the DB row would differ only in KV growth; read it at most every quiet_heartbeat
                self.next_hb[iid] += self.heartbeat_period * math.ceil((now - self.next_hb[iid]) / self.heartbeat_period + 1e-9)
                continue
            e.advance(now)
            self._collect(e, finished, interrupted)
            est = self.spec.estimates[iid].view
            before = (est.running, est.waiting, est.version, est.pulling)
            if self.spec.observe(e.snapshot(now, self.detail)):
                est = self.spec.estimates[iid].view
                if (est.running, est.waiting, est.version, est.pulling) != before:
                    changed = True
            self.engine_changed.discard(iid)
            nxt = self.next_hb[iid] + self.heartbeat_period
            if nxt <= now:
                nxt = now + self.heartbeat_period - ((now - self.next_hb[iid]) % self.heartbeat_period)
            self.next_hb[iid] = nxt
        return changed

    def _coordinate(self) -> tuple[bool, bool]:
        """One coordinator cycle: (issued anything, requeued samples that the next cycle must see)."""
        p, now, tbl = self.p, self.now, self.table
        self.cycles += 1
        t0 = time.perf_counter()
        reserved = p.reserved
        group_versions = {gid: g.min_version for gid, g in reserved.items()}
        admission = AdmissionView(
            p.buffers, p.version, p.limits, {gid: g.reserved_buffer for gid, g in reserved.items()}
        )
        plan = self.policy.plan(
            self.spec.views(copy=False), list(self.queued.values()), self.cost, ps_version=p.version,
            admission=admission, group_versions=group_versions,
        )
        self.coord_wall += time.perf_counter() - t0
        if plan.empty():
            return False, False
        touched: set[int] = set()
        if plan.routes:
            for r in plan.routes:  # engines must be at `now` before anything arrives
                if r.instance_id not in touched:
                    self.engines[r.instance_id].advance(now)
                    touched.add(r.instance_id)
            results = p.route([(r.sample_id, r.instance_id) for r in plan.routes])
            for r, res in zip(plan.routes, results):
                if res.outcome != RouteOutcome.ROUTED:
                    self.route_refusals += 1
                    continue
                sid, iid = r.sample_id, r.instance_id
                qs = self.queued.pop(sid)
                self.fresh_groups.discard(qs.group_id)
                e = self.engines[iid]
                tbl.v_traj[sid] = res.v_traj
                tbl.attempt[sid] = res.attempt
                tbl.seg0[sid] = tbl.gen[sid]
                tbl.seg_version[sid] = e.version
                tbl.ran_on[sid] = iid
                e.add(sid, now)
                self.spec.on_route(iid, qs.length, now)
            self.commands["route"] += len(plan.routes)
        requeued = False
        for pull in plan.pulls:
            e = self.engines[pull.instance_id]
            e.advance(now)
            touched.add(e.id)
            self._requeue(e.start_pull(now, pull.version, self.setup.pull_time))
            self.spec.on_pull(pull.instance_id, pull.version, now)
            self.commands["pull"] += 1
            requeued = True
        for it in plan.interrupts:
            e = self.engines[it.instance_id]
            e.advance(now)
            touched.add(e.id)
            got = e.interrupt(it.sample_ids, now)
            self._requeue(got)
            self.spec.on_interrupt(it.instance_id, got, now)
            self.commands["interrupt"] += len(got)
            self.commands[it.reason] += 1
            requeued = requeued or bool(got)
        for iid in touched:
            e = self.engines[iid]
            e.advance(now)  # admit what arrived
            self.engine_changed.add(iid)
            if e.finished or e.interrupted or e.pulled:
                requeued = True  # the outbox is drained at the next tick
            else:
                self.next_ev[iid] = e.next_event_time()
        return True, requeued

    # ---- the loop --------------------------------------------------------------------------

    def _next_time(self) -> float:
        t = self.last_coord + self.idle_cycle
        for te in self.next_ev.values():
            if te < t:
                t = te
        if self.train_until is not None and self.train_until < t:
            t = self.train_until
        for iid, hb in self.next_hb.items():
            if hb < t:
                est = self.spec.estimates[iid]
                if iid in self.engine_changed or est.last_change_at >= est.snapshot_at:
                    t = hb
        ticks = max(1, math.ceil((t - self.now) / self.period - 1e-9))
        return self.now + ticks * self.period

    def run(self, steps: int, max_virtual_time: float | None = None, progress: Callable[[str], None] | None = None) -> SimResult:
        wall0 = time.perf_counter()
        limit = max_virtual_time if max_virtual_time is not None else 200_000.0
        p = self.p
        self._top_up()
        self.next_ev = {iid: math.inf for iid in self.engines}
        self.engine_changed: set[int] = set()
        self.last_coord = -math.inf
        next_tick_now = True
        dirty = True
        last_reported = 0
        while p.version < steps and self.now < limit:
            self.now = self.now + self.period if next_tick_now else self._next_time()
            now = self.now
            self.pulls_done = False
            finished: list[int] = []
            interrupted: list[int] = []
            for iid, e in self.engines.items():
                if self.next_ev[iid] <= now or e.finished or e.interrupted or e.pulled:
                    e.advance(now)
                    self._collect(e, finished, interrupted)
            if self._heartbeats(finished, interrupted):
                dirty = True
            if interrupted:
                self._requeue(interrupted)
                dirty = True
            if finished and self._finish(finished):
                dirty = True
            if self.pulls_done:
                dirty = True
            if self._trainer():
                dirty = True
            if self._top_up():
                dirty = True
            next_tick_now = False
            if dirty or now - self.last_coord >= self.idle_cycle - 1e-9:
                self.last_coord = now
                dirty = False
                _, next_tick_now = self._coordinate()
                dirty = next_tick_now
            if progress is not None and p.version != last_reported:
                last_reported = p.version
                progress(f"step {p.version}/{steps} at {now:,.0f}s virtual")
        return self._result(steps, wall0)

    # ---- results ---------------------------------------------------------------------------

    def _result(self, steps: int, wall0: float) -> SimResult:
        p, su = self.p, self.setup
        done = p.version
        T = self.publish_times[-1] if self.publish_times else self.now
        for e in self.engines.values():  # bring lazily advanced engines to the end time
            e.advance(self.now)
        tokens = sum(self.step_tokens[:done])
        samples = sum(self.step_samples[:done])
        warm = min(max(1, done // 5), max(done - 1, 0))
        if done > warm and warm > 0:
            span = self.publish_times[done - 1] - self.publish_times[warm - 1]
            st_tokens = sum(self.step_tokens[warm:done])
            st_samples = sum(self.step_samples[warm:done])
            steady_tps = st_tokens / span if span > 0 else 0.0
            steady_sps = st_samples / span if span > 0 else 0.0
        else:
            steady_tps = tokens / T if T > 0 else 0.0
            steady_sps = samples / T if T > 0 else 0.0
        inst_time = sum(e.t for e in self.engines.values()) or 1.0
        idle = sum(e.idle for e in self.engines.values())
        pull = sum(e.pull_total for e in self.engines.values())
        ideal = ideal_tokens_per_s(su, self.seed)
        violations = list(dict.fromkeys(self.violations + p.check_invariants()))
        step_times = [b - a for a, b in zip([0.0] + self.publish_times[:-1], self.publish_times)]
        return SimResult(
            setup=su.name, policy=self.policy.name, eta=self.eta, steps=done, seed=self.seed,
            completed=done >= steps, virtual_time=T, wall_time=time.perf_counter() - wall0,
            trained_tokens=tokens, trained_prompt_tokens=self.trained_prompt_tokens, trained_samples=samples,
            trained_groups=sum(self.staleness.values()),
            tokens_per_s=tokens / T if T > 0 else 0.0, samples_per_s=samples / T if T > 0 else 0.0,
            steady_tokens_per_s=steady_tps, steady_samples_per_s=steady_sps, warmup_steps=warm,
            ideal_tokens_per_s=ideal, ratio_to_ideal=steady_tps / ideal if ideal else 0.0,
            rollout_idle_fraction=idle / inst_time, rollout_pull_fraction=pull / inst_time,
            trainer_idle_fraction=max(0.0, 1.0 - self.train_busy / T) if T > 0 else 1.0,
            staleness_hist=dict(sorted(self.staleness.items())),
            sample_staleness_hist=dict(sorted(self.sample_staleness.items())),
            step_times=step_times, train_times=list(self.train_times[:done]),
            generated_tokens=sum(e.tokens for e in self.engines.values()),
            prefill_tokens=sum(e.prefill_tokens for e in self.engines.values()),
            commands=dict(self.commands) | {"preemptions": sum(e.preemptions for e in self.engines.values())},
            cycles=self.cycles, coordinator_wall_s=self.coord_wall,
            snapshots={"accepted": self.spec.accepted, "dropped": self.spec.dropped},
            invariant_violations=violations, route_refusals=self.route_refusals,
        )


def simulate(
    setup: Setup | str,
    policy: Policy | str,
    eta: int = 2,
    steps: int = 20,
    seed: int = 0,
    *,
    progress: Callable[[str], None] | None = None,
    max_virtual_time: float | None = None,
    **options: Any,
) -> SimResult:
    """Simulate `steps` training steps of `setup` under `policy` with staleness bound `eta`
    (`sync` forces 0, `one_step` 1). Options: see `Simulator` (buffer_capacity,
    samples_per_group, heartbeat_period, idle_cycle, prefetch_groups, check_every_step)."""
    return Simulator(setup, policy, eta, seed, **options).run(steps, max_virtual_time, progress)
