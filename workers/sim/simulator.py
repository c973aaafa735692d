"""Discrete-event simulator of disaggregated RL post-training, in virtual time.

Pieces (none sleeps, none touches a database):

* the protocol — `SimProtocol`, i.e. `staleflow_db.reference.ReferenceProtocol`: every route
  (Reserve), segment report, reward (Occupy), consume and publish goes through it, so the
  simulated runs obey exactly the rules the real system does;
* rollout instances — `SimInstance`, continuous batching on the cost-model clock;
* a trainer — `SimTrainer`: consumes the ready buffer of its version, trains for a
  tokens-proportional time, publishes (the PS then holds the new version);
* the coordinator — every `policy.cycle_period` (100 ms) of virtual time: instance
  heartbeats feed the `SpeculativeState`, and `run_cycle` — the very cycle the real
  coordinator runs — plans routes, pulls and interrupts, applies them here (`_apply`: the
  protocol and the engines instead of the database) and feeds them back into the state.

Time advances in coordinator ticks. A tick in which nothing discrete happened (no finish,
no command, no publish, no pull done) and after which nothing can change until the next
engine event is skipped: the loop jumps to the tick of the next event (finishes, pull ends,
trainer done, a heartbeat that confirms an unconfirmed estimate) or at most `idle_cycle`
seconds ahead. Engines jump between their own events in closed form, so the cost of a run is
the number of events, not the number of tokens.

Multi-turn workloads: an instance keeps a trajectory between its turns while the environment
answers (`SimInstance`); a trajectory taken off its instance meanwhile (a pull, an interrupt)
is reported like any interrupted segment, and the simulator holds it back (`env_pending`)
until its environment answers, then queues it for routing like any partial sample.

Simplifications, all policy-neutral: rewards are instantaneous (one reward worker that
never lags), commands reach engines instantly (snapshot lag is modelled by the heartbeat
period instead), a segment is reported to the protocol as one placeholder token (the
protocol's decisions depend on whether a sample has tokens, not on how many; the real
counts live in the `SampleTable`).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from staleflow_db.types import Report, RunConfig
from workers.coordinator.admission import AdmissionView
from workers.coordinator.cycle import Applied, CycleOutcome, run_cycle
from workers.coordinator.policies import CyclePlan, Policy, get_policy
from workers.coordinator.state import QueuedSample, SpeculativeState
from workers.wire.enums import GroupState, SampleState, SegmentKind
from workers.wire.types import RouteOutcome

from .engine import SampleTable, SimInstance
from .protocol import SimProtocol
from .ps import PSEgress
from .results import SimResult, build_result, ideal_tokens_per_s
from .setups import PULL_OVERHEAD, Setup, get_setup
from .trainer import SimTrainer
from .workload import Workload

__all__ = ["SimResult", "Simulator", "ideal_tokens_per_s", "simulate"]

_ONE = [0]
_ONE_LP = [0.0]


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
        on_cycle: Callable[[CycleOutcome, float, float], None] | None = None,
    ):
        self.setup = get_setup(setup)
        self.policy = get_policy(policy)
        self.seed = seed
        self.eta = self.policy.effective_eta(eta)
        su = self.setup
        self.cost = su.cost
        self.workload = Workload(su.workload, seed)
        if su.kv_capacity < su.workload.max_context:
            raise ValueError(f"{su.name}: KV capacity {su.kv_capacity} cannot hold one longest sample")
        cfg = RunConfig(
            batch_size=su.batch_size,
            group_size=su.group_size,
            eta=self.eta,
            buffer_capacity=buffer_capacity or 0,
            samples_per_group=samples_per_group or 0,
            max_response_tokens=su.max_response,
            max_prompt_tokens=su.workload.prompt_max,
        )
        self.p = SimProtocol(cfg)
        self.n_prime = cfg.samples_per_group
        self.table = SampleTable()
        self.spec = SpeculativeState(tolerance=snapshot_tolerance)
        self.period = self.policy.cycle_period
        self.heartbeat_period = heartbeat_period
        self.quiet_heartbeat = max(quiet_heartbeat, heartbeat_period)
        self.idle_cycle = max(idle_cycle, self.period)
        self.prefetch = prefetch_groups if prefetch_groups is not None else max(4, su.batch_size // 16)
        self.check_every_step = check_every_step
        # called after each cycle with its outcome and the coordinator's own wall and CPU
        # seconds in run_cycle (the simulator's side, `_apply`, excluded): bench/coordinator.py
        self.on_cycle = on_cycle
        self.apply_s = self.apply_cpu_s = 0.0
        self.detail = self.policy.reads_running_samples
        rng = np.random.default_rng([seed, 7])
        self.engines: dict[int, SimInstance] = {}
        self.next_hb: dict[int, float] = {}
        for _ in range(su.instances):
            iid = self.p.register_instance(0)
            e = SimInstance(
                iid,
                self.cost,
                su.kv_capacity,
                su.max_running,
                su.prefill_rate,
                self.table,
                version=0,
                phi_wait=self.policy.phi,
                attn_coef=su.attn_coef,
            )
            self.engines[iid] = e
            self.spec.observe(e.snapshot(0.0, self.detail))
            self.next_hb[iid] = float(rng.uniform(0, heartbeat_period))
        self.queued: dict[int, QueuedSample] = {}  # insertion order = FIFO
        # trajectories off any instance, waiting for their environment: sid -> answer time
        self.env_pending: dict[int, float] = {}
        self._env_heap: list[tuple[float, int]] = []
        self.route_tokens: dict[int, str] = {}  # sample -> token of its latest route (reports quote it)
        self.fresh_groups: set[int] = set()
        self.group_index = 0
        self.trainer = SimTrainer(self.p, self.table, su)
        self.ps = PSEgress(su.ps_streams, su.pull_transfer_time, PULL_OVERHEAD)
        self.commands: Counter[str] = Counter()
        self.cycles = 0
        self.coord_wall = 0.0
        self.route_refusals = 0
        self.requeued = False  # set by the latest cycle's commands
        self.violations: list[str] = []
        self.now = 0.0
        self.regime_log: list[tuple[float, str, str, bool]] = []  # per cycle (_record_regime)

    # ---- the dataset -----------------------------------------------------------------------

    def _top_up(self) -> bool:
        added = False
        while len(self.fresh_groups) < self.prefetch:
            k = self.group_index
            self.group_index += 1
            draw = self.workload.group(k, self.n_prime)
            gid = self.p.enqueue(f"g{k}", [1] * draw.prompt_len)
            for j, sid in enumerate(self.p.groups[gid].sample_ids):
                plan = draw.plan(j)
                target = int(draw.lengths[j]) if plan is None else plan[0][0]  # multi-turn: the first turn's end
                self.table.add(sid, gid, draw.prompt_len, target, plan)
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
            sid,
            tbl.attempt[sid],
            tbl.seg_version[sid],
            _ONE if has else [],
            _ONE_LP if has else [],
            kind,
            instance_id=tbl.ran_on[sid],
            route_token=self.route_tokens[sid],
        )

    def _requeue(self, sids: list[int]) -> None:
        """Report interrupted segments; the samples return to the queue with their tokens."""
        if not sids:
            return
        self.p.report([self._segment_report(s, SegmentKind.INTERRUPTED) for s in sids])
        tbl = self.table
        for sid in sids:
            tbl.instance[sid] = 0
            ready = tbl.env_ready[sid]
            if ready > self.now:  # between turns: it is routable once its environment answers
                self.env_pending[sid] = ready
                heapq.heappush(self._env_heap, (ready, sid))
                self.commands["between_turns"] += 1  # taken off its instance while its environment works
                continue
            if ready:
                tbl.env_answer(sid)
            self._queue(sid)

    def _queue(self, sid: int) -> None:
        tbl = self.table
        g = tbl.gen[sid]
        self.queued[sid] = QueuedSample(
            sid,
            tbl.group[sid],
            tbl.prompt[sid] + g,
            tbl.v_traj[sid],
            g,
            tbl.last_version[sid],
            tbl.ran_on[sid] or None,
        )

    def _env_answers(self) -> bool:
        """Queue the held-back trajectories whose environment has answered; True if any."""
        heap, pending, got = self._env_heap, self.env_pending, False
        while heap and heap[0][0] <= self.now:
            ready, sid = heapq.heappop(heap)
            if pending.get(sid) != ready:
                continue
            del pending[sid]
            self.table.env_answer(sid)
            self._queue(sid)
            got = True
        return got

    def _drop_aborted(self, group_ids) -> None:
        """Samples the protocol aborted (surplus, dropped groups) leave engines and queue."""
        for gid in group_ids:
            for sid in self.p.groups[gid].sample_ids:
                if self.p.samples[sid].state != SampleState.ABORTED:
                    continue
                self.queued.pop(sid, None)
                self.env_pending.pop(sid, None)
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
        if touched and (
            self.n_prime > self.p.config.group_size or any(o.state != GroupState.OCCUPIED for o in outcomes)
        ):
            self._drop_aborted(touched)
        return bool(outcomes)

    # ---- trainer ---------------------------------------------------------------------------

    def _trainer(self) -> bool:
        """Publish a finished step, start the next; True if either happened."""
        aborted = self.trainer.publish_due(self.now)
        if aborted is not None:
            self._drop_aborted(aborted)
            if self.check_every_step:
                self.violations.extend(self.p.check_invariants())
        started = self.trainer.start_step(self.now)
        return aborted is not None or started

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
        if e.turned:  # a turn ended or an environment answered: the snapshot changed
            e.turned = False
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
                self.next_hb[iid] += self.heartbeat_period * math.ceil(
                    (now - self.next_hb[iid]) / self.heartbeat_period + 1e-9
                )
                continue
            e.advance(now)
            self._collect(e, finished, interrupted)
            view = self.spec.estimates[iid].view
            before = (view.running, view.waiting, view.version, view.pulling)
            if self.spec.observe(e.snapshot(now, self.detail)):
                view = self.spec.estimates[iid].view
                if (view.running, view.waiting, view.version, view.pulling) != before:
                    changed = True
            self.engine_changed.discard(iid)
            nxt = self.next_hb[iid] + self.heartbeat_period
            if nxt <= now:
                nxt = now + self.heartbeat_period - ((now - self.next_hb[iid]) % self.heartbeat_period)
            self.next_hb[iid] = nxt
        return changed

    def _coordinate(self) -> tuple[bool, bool]:
        """One coordinator cycle: (issued anything, requeued samples that the next cycle must see)."""
        p = self.p
        self.cycles += 1
        reserved = p.reserved
        self.apply_s = self.apply_cpu_s = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        out = run_cycle(
            self.policy,
            self.cost,
            self.spec,
            self.queued.values(),
            self._apply,
            ps_version=p.version,
            # a reserved group has its buffer and version (the reference protocol's types allow None)
            admission=AdmissionView(
                p.buffers, p.version, p.limits, {gid: g.reserved_buffer or 0 for gid, g in reserved.items()}
            ),
            group_versions={gid: g.min_version or 0 for gid, g in reserved.items()},
            max_response=self.setup.max_response,
            pull_streams=self.setup.ps_streams,
            now=self.now,
        )
        self._record_regime()
        if self.on_cycle is not None:
            wall, cpu = time.perf_counter() - t0 - self.apply_s, time.thread_time() - c0 - self.apply_cpu_s
            self.on_cycle(out, wall, cpu)
        self.coord_wall += out.decide_s
        self.route_refusals += out.refused
        return not out.plan.empty(), self.requeued

    def _record_regime(self) -> None:
        """Per cycle: the coordinator's regime estimate and label, and whether the trainer
        waits for a buffer one of whose samples sits in the queue (critical-path routing could
        act only then: docs/policies.md). Summed over time by `build_result`."""
        p = self.p
        gating = False
        if self.trainer.until is None:  # idle: it waits for the buffer of the run's version
            reserved = p.reserved
            gating = any(
                (g := reserved.get(q.group_id)) is not None and g.reserved_buffer == p.version
                for q in self.queued.values()
            )
        self.regime_log.append((self.now, self.spec.regime.regime, self.spec.regime_label, gating))

    def _apply(self, plan: CyclePlan) -> Applied:
        """The cycle's commands reach the protocol and the engines at once (`requeued`: some
        samples went back to the queue, or an engine has an outbox to drain next tick)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._apply_plan(plan)
        finally:
            self.apply_s += time.perf_counter() - t0
            self.apply_cpu_s += time.thread_time() - c0

    def _apply_plan(self, plan: CyclePlan) -> Applied:
        p, now, tbl = self.p, self.now, self.table
        self.requeued, touched = False, set()
        routed: list[bool] = []
        interrupted: list[list[int]] = []
        if plan.routes:
            for r in plan.routes:  # engines must be at `now` before anything arrives
                if r.instance_id not in touched:
                    self.engines[r.instance_id].advance(now)
                    touched.add(r.instance_id)
            results = p.route([(r.sample_id, r.instance_id) for r in plan.routes])
            for r, res in zip(plan.routes, results):
                routed.append(res.outcome == RouteOutcome.ROUTED)
                if not routed[-1]:
                    continue
                sid, iid = r.sample_id, r.instance_id
                assert res.v_traj is not None and res.attempt is not None and res.route_token is not None  # routed
                qs = self.queued.pop(sid)
                self.fresh_groups.discard(qs.group_id)
                e = self.engines[iid]
                tbl.v_traj[sid] = res.v_traj
                tbl.attempt[sid] = res.attempt
                self.route_tokens[sid] = res.route_token
                tbl.seg0[sid] = tbl.gen[sid]
                tbl.seg_version[sid] = e.version
                tbl.ran_on[sid] = iid
                e.add(sid, now)
            self.commands["route"] += len(plan.routes)
        pull_s = self.ps.pull_durations(now, len(plan.pulls)) if plan.pulls else 0.0
        for pull in plan.pulls:
            e = self.engines[pull.instance_id]
            e.advance(now)
            touched.add(e.id)
            self._requeue(e.start_pull(now, pull.version, pull_s))
            self.commands["pull"] += 1
            self.requeued = True
        for it in plan.interrupts:
            e = self.engines[it.instance_id]
            e.advance(now)
            touched.add(e.id)
            got = e.interrupt(it.sample_ids, now)
            self._requeue(got)
            interrupted.append(got)
            self.commands["interrupt"] += len(got)
            self.commands[it.reason] += 1
            self.requeued = self.requeued or bool(got)
        for iid in touched:
            e = self.engines[iid]
            e.advance(now)  # admit what arrived
            self.engine_changed.add(iid)
            if e.finished or e.interrupted or e.pulled:
                self.requeued = True  # the outbox is drained at the next tick
            else:
                self.next_ev[iid] = e.next_event_time()
        return Applied(routed, interrupted, now)

    # ---- the loop --------------------------------------------------------------------------

    def _next_time(self) -> float:
        t = self.last_coord + self.idle_cycle
        for te in self.next_ev.values():
            if te < t:
                t = te
        if self.trainer.until is not None and self.trainer.until < t:
            t = self.trainer.until
        if self.env_pending:
            while self._env_heap and self.env_pending.get(self._env_heap[0][1]) != self._env_heap[0][0]:
                heapq.heappop(self._env_heap)
            if self._env_heap and self._env_heap[0][0] < t:
                t = self._env_heap[0][0]
        for iid, hb in self.next_hb.items():
            if hb < t:
                est = self.spec.estimates[iid]
                if iid in self.engine_changed or est.last_change_at >= est.snapshot_at:
                    t = hb
        ticks = max(1, math.ceil((t - self.now) / self.period - 1e-9))
        return self.now + ticks * self.period

    def run(
        self, steps: int, max_virtual_time: float | None = None, progress: Callable[[str], None] | None = None
    ) -> SimResult:
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
            if self.env_pending and self._env_answers():
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
        return build_result(self, steps, wall0)


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
