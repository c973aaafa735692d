"""Coordinator strategies (SPEC §4) as pure functions.

Inputs: instance views (the speculative state), queued samples, the cost model, an
admission oracle and parameters. Outputs: lists of decisions. No I/O and no clock reads;
strategies update private copies of the views as they decide, never the caller's objects.

* Routing — `route_waterfall`: multi-level queue by version (oldest level first; a level that
  cannot be fully routed blocks newer levels this cycle) and, per sample, the instance with
  the largest marginal throughput gain ΔT_i = T(n_i+1, kv_i+l) - T(n_i, kv_i) among those that
  may run it, routed only if ΔT_i >= μ·T(1, l). Naive form: `route_request_count`.
* Synchronization — `sync_status_based`: pull only when behind the PS, nothing waiting,
  nothing routable at the current version and KV usage at or below a threshold. Naive forms:
  `sync_greedy` (pull as soon as behind) and `sync_all_idle` (whole-batch version, no partial
  rollout: everyone pulls together once all are idle).
* Migration — `migrate_throughput_ratio` (coordinator side, ψ, one per cycle) and
  `engine_should_interrupt_preempted` (engine side, φ_wait).

Admission (will the protocol's Reserve succeed?) is asked through an `Admission` object:
`AdmissionView` models the buffer counters with the protocol's own placement rules
(`staleflow_db.rules.route_decision`) and records the reservations this cycle's routes make;
`CallbackAdmission` wraps any callable, e.g. one that asks the database.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Container, Hashable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from staleflow_db.rules import BufferCounts, Limits, route_decision

from .cost_model import CostModel
from .state import InstanceView, QueuedSample, RunningSample

NEW_LEVEL = math.inf  # level of samples of groups not yet in flight: the newest work


# ---- decisions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteDecision:
    sample_id: int
    instance_id: int


@dataclass(frozen=True)
class PullDecision:
    instance_id: int
    version: int  # the version to load (the PS's latest)


@dataclass(frozen=True)
class InterruptDecision:
    instance_id: int
    sample_ids: tuple[int, ...]
    reason: str = "migration"


# ---- admission -------------------------------------------------------------------------------


class Admission(Protocol):
    """`admits`: would routing `sample` to an instance at `instance_version` be accepted?
    `commit`: it was decided; account for it (later answers see it). Optionally `key(sample)`:
    samples with equal keys get equal answers at every version until the next commit — lets
    strategies ask once per class of samples instead of once per sample."""

    def admits(self, sample: QueuedSample, instance_version: int) -> bool: ...

    def commit(self, sample: QueuedSample, instance_version: int) -> None: ...


class AlwaysAdmit:
    def admits(self, sample: QueuedSample, instance_version: int) -> bool:
        return True

    def commit(self, sample: QueuedSample, instance_version: int) -> None:
        pass

    def key(self, sample: QueuedSample) -> Hashable:
        return ()


class CallbackAdmission:
    """Wrap `fn(sample, instance_version) -> bool` (and an optional `on_commit`)."""

    def __init__(self, fn: Callable[[QueuedSample, int], bool], on_commit: Callable[[QueuedSample, int], None] | None = None):
        self.fn, self.on_commit = fn, on_commit

    def admits(self, sample: QueuedSample, instance_version: int) -> bool:
        return bool(self.fn(sample, instance_version))

    def commit(self, sample: QueuedSample, instance_version: int) -> None:
        if self.on_commit is not None:
            self.on_commit(sample, instance_version)


class AdmissionView:
    """What the protocol's route would answer, without touching it (copy-on-write counters).

    `reserved` maps each in-flight group to its reserved buffer; groups in `closed` (occupied,
    consumed, dropped) admit nothing; other groups are queued (their first route reserves).
    """

    def __init__(
        self,
        buffers: Mapping[int, BufferCounts],
        version_now: int,
        limits: Limits,
        reserved: Mapping[int, int],
        closed: Container[int] = (),
    ):
        self._buffers = buffers
        self._copied: dict[int, BufferCounts] = {}
        self.version_now = version_now
        self.limits = limits
        self._reserved = reserved
        self._new_reserved: dict[int, int] = {}
        self._closed = closed
        self._memo: dict[tuple, bool] = {}

    def _buffer_map(self) -> Mapping[int, BufferCounts]:
        if not self._copied:
            return self._buffers
        merged = dict(self._buffers)
        merged.update(self._copied)
        return merged

    def group_buffer(self, group_id: int) -> int | None:
        b = self._new_reserved.get(group_id)
        return b if b is not None else self._reserved.get(group_id)

    def decision(self, sample: QueuedSample, instance_version: int) -> tuple[str, int | None, int | None]:
        if sample.group_id in self._closed:
            return "group_closed", None, None
        return route_decision(
            has_tokens=sample.tokens > 0,
            v_traj=sample.v_traj,
            last_version=sample.last_version,
            instance_version=instance_version,
            group_reserved_buffer=self.group_buffer(sample.group_id),
            buffers=self._buffer_map(),
            version_now=self.version_now,
            limits=self.limits,
        )

    def key(self, sample: QueuedSample) -> Hashable:
        """Everything `route_decision` reads of a sample: equal keys, equal answers."""
        if sample.group_id in self._closed:
            return ("closed",)
        return (sample.tokens > 0, sample.v_traj, sample.last_version, self.group_buffer(sample.group_id))

    def admits(self, sample: QueuedSample, instance_version: int) -> bool:
        k = (self.key(sample), instance_version)
        ok = self._memo.get(k)
        if ok is None:
            ok = self._memo[k] = self.decision(sample, instance_version)[0] == "routed"
        return ok

    def commit(self, sample: QueuedSample, instance_version: int) -> None:
        outcome, _, b = self.decision(sample, instance_version)
        if outcome != "routed" or b is None:
            return
        if b not in self._copied:
            old = self._buffers.get(b)
            self._copied[b] = BufferCounts(b, old.occupied, old.reserved, old.consumed) if old else BufferCounts(b)
        self._copied[b].reserved += 1
        self._new_reserved[sample.group_id] = b
        self._memo.clear()  # buffer counters changed


# ---- queue levels ----------------------------------------------------------------------------


def level_of(sample: QueuedSample, group_versions: Mapping[int, int] | None) -> float:
    """A sample with tokens: its V_traj. A fresh member of an in-flight group: the group's
    version. A member of a group not yet in flight: `NEW_LEVEL` (newest)."""
    if sample.tokens > 0 and sample.v_traj is not None:
        return sample.v_traj
    if group_versions is not None:
        gv = group_versions.get(sample.group_id)
        if gv is not None:
            return gv
    return NEW_LEVEL


def queue_levels(
    queued: Iterable[QueuedSample], group_versions: Mapping[int, int] | None = None
) -> list[tuple[float, list[QueuedSample]]]:
    """Queued samples by level (see `level_of`), oldest first; the caller's order is kept
    inside a level."""
    levels: dict[float, list[QueuedSample]] = {}
    gv = group_versions or {}
    for s in queued:
        if s.tokens > 0 and s.v_traj is not None:
            key = s.v_traj
        else:
            key = gv.get(s.group_id, NEW_LEVEL)
        lst = levels.get(key)
        if lst is None:
            levels[key] = [s]
        else:
            lst.append(s)
    return sorted(levels.items(), key=lambda kv: kv[0])


Levels = list[tuple[float, list[QueuedSample]]]


# ---- routing ---------------------------------------------------------------------------------


class _Cluster:
    """Numpy arrays over the instances, updated as routes are decided."""

    def __init__(self, instances: Sequence[InstanceView], cost: CostModel):
        self.ids = [i.instance_id for i in instances]
        self.version = np.array([i.version for i in instances], dtype=np.int64)
        self.n = np.array([i.running for i in instances], dtype=float)
        self.waiting = np.array([i.waiting for i in instances], dtype=float)
        self.kv = np.array([i.kv_used for i in instances], dtype=float)
        self.cap = np.array([i.kv_capacity for i in instances], dtype=float)
        self.max_running = np.array([i.max_running for i in instances], dtype=float)
        self.open = np.array([not i.pulling for i in instances], dtype=bool)
        self.cost = cost
        self.T = cost.throughput_array(self.n, self.kv)
        self.versions = sorted(set(int(v) for v in self.version))
        self.vidx = np.searchsorted(np.array(self.versions), self.version)


def _admission_rows(samples: Sequence[QueuedSample], admission: Admission, versions: Sequence[int]) -> np.ndarray:
    """[sample, version] -> would the reserve / join succeed (asked once per sample class)."""
    keyf = getattr(admission, "key", None)
    out = np.empty((len(samples), len(versions)), dtype=bool)
    memo: dict = {}
    for q, s in enumerate(samples):
        k = keyf(s) if keyf is not None else None
        row = memo.get(k) if k is not None else None
        if row is None:
            row = [admission.admits(s, v) for v in versions]
            if k is not None:
                memo[k] = row
        out[q] = row
    return out


def route_waterfall(
    instances: Sequence[InstanceView],
    queued: Iterable[QueuedSample],
    cost: CostModel,
    admission: Admission | None = None,
    *,
    mu: float = 0.25,
    group_versions: Mapping[int, int] | None = None,
    block_scope: str = "instance",
    levels: Levels | None = None,
) -> list[RouteDecision]:
    """Multi-level queue + waterfall (SPEC §4).

    Levels are served oldest first (`queue_levels`). Inside a level samples are taken in
    order; for each, the eligible instances are those not pulling, with an empty waiting
    queue, a free running slot, KV room (kv + l <= capacity), version >= the sample's latest
    segment version, and where the reserve would succeed; the one with the largest
    ΔT = T(n+1, kv+l) - T(n, kv) gets it if ΔT >= μ·T(1, l), otherwise the sample waits.

    Blocking: after a level in which some sample could not be routed, newer levels may not
    use the instances that could have run the failed samples (`block_scope="instance"`, the
    default: instances whose version is too low for the old work stay open to newer work),
    or no instance at all (`block_scope="all"`: the level blocks everything newer). When every
    instance can run the old level, the two are the same.

    The result equals routing samples one by one in that order; it is computed on a
    [sample x instance] matrix per level, updating one column per decided route.
    """
    admission = admission or AlwaysAdmit()
    if not instances:
        return []
    if levels is None:
        levels = queue_levels(queued, group_versions)
    c = _Cluster(instances, cost)
    blocked = np.zeros(len(c.ids), dtype=bool)
    routes: list[RouteDecision] = []
    a, ak = cost.attn_b, cost.attn_k
    thr_c, ob, ok_ = cost.other_threshold, cost.other_b, cost.other_k
    for level, samples in levels:
        base = c.open & ~blocked & (c.waiting == 0) & (c.n < c.max_running)
        if not base.any():
            break
        if level == NEW_LEVEL and not any(admission.admits(samples[0], v) for v in c.versions):
            # every member of the newest level is a never-routed member of a group not yet in
            # flight: when one cannot reserve at any version, none can (the budget is full)
            failed_need = 0
            break
        m = len(samples)
        L = np.array([s.length for s in samples], dtype=float)
        need = np.array([s.min_instance_version for s in samples], dtype=np.int64)
        adm = _admission_rows(samples, admission, c.versions)
        thresh = mu * cost.throughput_array(np.ones(m), L)  # μ·ΔT_ideal, ΔT_ideal = T(1, l)

        def feasible(rows: slice) -> np.ndarray:
            return (
                base[None, :]
                & (c.version[None, :] >= need[rows, None])
                & (c.kv[None, :] + L[rows, None] <= c.cap[None, :])
                & adm[rows][:, c.vidx]
            )

        def gains(rows: slice, cols) -> np.ndarray:
            n1 = c.n[cols] + 1
            lat = a + ak * (c.kv[cols][None, :] + L[rows, None]) + np.maximum(thr_c, ob + ok_ * n1)[None, :]
            return n1[None, :] / lat - c.T[cols][None, :]

        allc = slice(None)
        F = feasible(slice(0, m))
        G = gains(slice(0, m), allc)
        score = np.where(F, G, -np.inf)
        failed_need: int | None = None
        q0 = 0
        while q0 < m:
            best = score[q0:].max(axis=1)
            ok = best >= thresh[q0:]
            hits = np.flatnonzero(ok)
            stop = q0 + int(hits[0]) if len(hits) else m
            if stop > q0:  # rows q0..stop-1 could not be routed (state unchanged since)
                fneed = int(need[q0:stop].min())
                failed_need = fneed if failed_need is None else min(failed_need, fneed)
            if stop >= m:
                break
            q = stop
            j = int(np.argmax(score[q]))
            s = samples[q]
            admission.commit(s, int(c.version[j]))
            routes.append(RouteDecision(s.sample_id, c.ids[j]))
            c.n[j] += 1
            c.kv[j] += L[q]
            c.T[j] = cost.throughput(c.n[j], c.kv[j])
            q0 = q + 1
            if q0 >= m:
                break
            rest = slice(q0, m)
            if level == NEW_LEVEL or not hasattr(admission, "key"):
                # a new reservation: buffer counters and this group's status changed
                adm[q0:] = _admission_rows(samples[q0:], admission, c.versions)
                base = c.open & ~blocked & (c.waiting == 0) & (c.n < c.max_running)
                F_rest = feasible(rest)
                G[q0:, j] = gains(rest, [j])[:, 0]
                score[q0:] = np.where(F_rest, G[q0:], -np.inf)
            else:
                if c.n[j] >= c.max_running[j]:
                    base[j] = False
                col = base[j] & (c.version[j] >= need[q0:]) & (c.kv[j] + L[q0:] <= c.cap[j]) & adm[q0:, c.vidx[j]]
                G[q0:, j] = gains(rest, [j])[:, 0]
                score[q0:, j] = np.where(col, G[q0:, j], -np.inf)
        if failed_need is not None:
            if block_scope == "all":
                break
            blocked |= c.version >= failed_need
            if blocked.all():
                break
    return routes


def route_request_count(
    instances: Sequence[InstanceView],
    queued: Iterable[QueuedSample],
    admission: Admission | None = None,
    *,
    group_versions: Mapping[int, int] | None = None,
    max_requests: int | None = None,
    levels: Levels | None = None,
    sticky: bool = False,
) -> list[RouteDecision]:
    """Naive balancing: every routable sample to the instance with the fewest requests
    (running + waiting), oldest level first, no throughput model, no KV or waiting-queue
    checks (the engine queues what does not fit). Requests per instance are capped at
    `max_requests`, by default at the engine's running slots (`max_running`, vLLM's
    max_num_seqs): beyond that, work waits in the central queue rather than piling onto
    whichever instance happens to be free first.

    `sticky`: a sample that has tokens resumes only on the instance it last ran on (no
    migration: systems without it continue an interrupted rollout where it was)."""
    admission = admission or AlwaysAdmit()
    if not instances:
        return []
    if levels is None:
        levels = queue_levels(queued, group_versions)
    ids = [i.instance_id for i in instances]
    versions = np.array([i.version for i in instances], dtype=np.int64)
    load = np.array([i.running + i.waiting for i in instances], dtype=float)
    open_ = np.array([not i.pulling for i in instances], dtype=bool)
    if max_requests is None:
        cap = np.array([i.max_running for i in instances], dtype=float)
    else:
        cap = np.full(len(instances), float(max_requests))
    distinct = sorted(set(int(v) for v in versions))
    by_version = {v: versions == v for v in distinct}
    routes = []
    index = {iid: k for k, iid in enumerate(ids)}
    for level, samples in levels:
        if level == NEW_LEVEL and not any(admission.admits(samples[0], v) for v in distinct):
            continue  # no new group can reserve at any version (see route_waterfall)
        for s in samples:
            if sticky and s.tokens > 0 and s.last_instance is not None:
                k = index.get(s.last_instance)
                if k is None or not open_[k] or load[k] >= cap[k] or versions[k] < s.min_instance_version:
                    continue
                if not admission.admits(s, int(versions[k])):
                    continue
                admission.commit(s, int(versions[k]))
                load[k] += 1
                routes.append(RouteDecision(s.sample_id, ids[k]))
                continue
            mask = open_ & (load < cap)
            need = s.min_instance_version
            if need > 0:
                mask &= versions >= need
            if not mask.any():
                continue
            for v in distinct:
                sel = by_version[v]
                if (mask & sel).any() and not admission.admits(s, v):
                    mask = mask & ~sel
            if not mask.any():
                continue
            masked = np.where(mask, load, np.inf)
            j = int(np.argmin(masked))
            admission.commit(s, int(versions[j]))
            load[j] += 1
            routes.append(RouteDecision(s.sample_id, ids[j]))
    return routes


def apply_routes(
    instances: Sequence[InstanceView], routes: Sequence[RouteDecision], queued: Mapping[int, QueuedSample]
) -> list[InstanceView]:
    """Views after the routes (copies): +1 request and +len KV each (waiting when it won't fit).
    Like the speculative state, per-sample details are left to the next snapshot."""
    out = {i.instance_id: i.copy() for i in instances}
    for r in routes:
        v, s = out[r.instance_id], queued[r.sample_id]
        if v.kv_used + s.length <= v.kv_capacity and v.running < v.max_running:
            v.running += 1
            v.kv_used += s.length
        else:
            v.waiting += 1
    return [out[i.instance_id] for i in instances]


# ---- what is still routable ------------------------------------------------------------------


def routable_versions(
    versions: Iterable[int],
    queued: Iterable[QueuedSample] | None,
    admission: Admission | None = None,
    group_versions: Mapping[int, int] | None = None,
    *,
    levels: Levels | None = None,
    exclude: Container[int] = (),
) -> dict[int, bool]:
    """For each instance version: could some queued sample still be routed at it?

    A sample with tokens can run at versions >= its latest segment's (>= V_traj); one without
    tokens at any version >= its V_traj (if it was routed before); either only where its
    reserve (or group join) would be accepted. Samples in `exclude` (e.g. just routed) are
    ignored. Every member of the newest level belongs to a group not yet in flight and was
    never routed, so one of them answers for all.
    """
    admission = admission or AlwaysAdmit()
    pending = sorted(set(versions))
    out = {v: False for v in pending}
    if levels is None:
        levels = queue_levels(queued or (), group_versions)
    for level, samples in levels:
        if not pending:
            break
        if level == NEW_LEVEL:
            rep = next((x for x in samples if x.sample_id not in exclude), None)
            if rep is not None:
                for v in pending:
                    if admission.admits(rep, v):
                        out[v] = True
            pending = [v for v in pending if not out[v]]
            continue
        for x in samples:
            if x.sample_id in exclude:
                continue
            need = x.min_instance_version
            hit = False
            for v in pending:
                if v >= need and admission.admits(x, v):
                    out[v] = hit = True
            if hit:
                pending = [v for v in pending if not out[v]]
                if not pending:
                    break
    return out


# ---- synchronization -------------------------------------------------------------------------


def sync_status_based(
    instances: Sequence[InstanceView],
    ps_version: int,
    routable: Mapping[int, bool] | Callable[[int], bool],
    *,
    kv_threshold: float = 0.3,
) -> list[PullDecision]:
    """Pull instance i only when it is behind the PS, its waiting queue is empty, no queued
    sample can still be routed to it at its current version, and its KV usage is at or below
    `kv_threshold` (SPEC §4). Staying on an old version while old work remains is safe."""
    is_routable = routable if callable(routable) else (lambda v: routable.get(v, False))
    pulls = []
    for i in instances:
        if i.pulling or i.version >= ps_version or i.waiting > 0:
            continue
        if is_routable(i.version):
            continue
        if i.kv_usage > kv_threshold:
            continue
        pulls.append(PullDecision(i.instance_id, ps_version))
    return pulls


def sync_greedy(instances: Sequence[InstanceView], ps_version: int) -> list[PullDecision]:
    """Naive: pull (interrupting whatever runs) as soon as a newer version exists."""
    return [PullDecision(i.instance_id, ps_version) for i in instances if not i.pulling and i.version < ps_version]


def sync_all_idle(
    instances: Sequence[InstanceView],
    ps_version: int,
    routable: Mapping[int, bool] | Callable[[int], bool],
) -> list[PullDecision]:
    """Whole-batch version, no partial rollout: once no instance runs or waits on anything and
    nothing is routable at its version, every instance behind the PS pulls together."""
    is_routable = routable if callable(routable) else (lambda v: routable.get(v, False))
    live = [i for i in instances if not i.pulling]
    if not any(i.version < ps_version for i in live):
        return []
    for i in live:
        if i.running or i.waiting or is_routable(i.version):
            return []
    return [PullDecision(i.instance_id, ps_version) for i in live if i.version < ps_version]


def apply_pulls(instances: Sequence[InstanceView], pulls: Sequence[PullDecision]) -> list[InstanceView]:
    by_id = {p.instance_id: p for p in pulls}
    out = []
    for i in instances:
        i = i.copy()
        p = by_id.get(i.instance_id)
        if p is not None:
            i.running = i.waiting = i.kv_used = 0
            i.running_samples = ()
            i.pulling, i.version = True, p.version
        out.append(i)
    return out


# ---- migration -------------------------------------------------------------------------------


def migrate_throughput_ratio(
    instances: Sequence[InstanceView],
    routable: Mapping[int, bool] | Callable[[int], bool],
    cost: CostModel,
    *,
    psi: float = 2.0,
    min_running: int = 2,
    min_gain: float = 0.05,
    use_measured: bool = False,
    max_tries: int = 8,
) -> list[InterruptDecision]:
    """Coordinator-side migration, at most one per cycle (SPEC §4).

    Trigger: a starved instance (not pulling, nothing waiting, nothing routable at its
    version) whose throughput is less than 1/ψ of a loaded instance's (same or older version,
    so the starved one may continue the loaded one's samples). T is the cost model's
    T(n, kv), or the measured throughput with `use_measured`.

    Move: the loaded instance's longest samples (most tokens so far: under long-tailed
    lengths, the most left to generate) are interrupted so the next routing spreads them —
    as many as maximise the pair's combined cost-model throughput, at most half the
    difference in running counts, within the starved one's free KV. Nothing moves unless the
    combined throughput rises by `min_gain` (a fraction): below the cost model's knee every
    sample decodes at the same speed wherever it runs, and a move would only pay prefill.
    """
    is_routable = routable if callable(routable) else (lambda v: routable.get(v, False))

    def thr(i: InstanceView) -> float:
        return i.throughput if use_measured else cost.throughput(i.running, i.kv_used)

    live = [i for i in instances if not i.pulling]
    starved = [i for i in live if i.waiting == 0 and not is_routable(i.version)]
    if not starved:
        return []
    loaded = sorted(((thr(l), l) for l in live if l.running >= min_running), key=lambda x: -x[0])
    if not loaded:
        return []
    starved_t = sorted(((thr(s), s) for s in starved), key=lambda x: x[0])
    if loaded[0][0] <= psi * starved_t[0][0]:
        return []  # no pair passes the ψ trigger
    pairs: list[tuple[float, float, InstanceView, InstanceView]] = []
    for ts, s in starved_t:
        for tl, l in loaded:
            if tl <= psi * ts:
                break  # sorted: no later loaded instance passes either
            if l.instance_id == s.instance_id or l.version > s.version or l.running - s.running < 2:
                continue
            pairs.append((math.inf if ts <= 0 else tl / ts, tl, s, l))
    pairs.sort(key=lambda x: (x[0], x[1]), reverse=True)
    for _, _, s, l in pairs[:max_tries]:
        ids = _best_move(s, l, cost, min_gain)
        if ids:
            return [InterruptDecision(l.instance_id, ids, "migration")]
    return []


def _best_move(s: InstanceView, l: InstanceView, cost: CostModel, min_gain: float) -> tuple[int, ...]:
    kmax = (l.running - s.running) // 2
    room = s.kv_capacity - s.kv_used
    before = cost.throughput(l.running, l.kv_used) + cost.throughput(s.running, s.kv_used)
    candidates = sorted(
        (r for r in l.running_samples if r.v_traj <= s.version), key=lambda r: (-r.tokens, r.sample_id)
    )
    chosen: list[int] = []
    moved_kv = 0
    best_total, best_k = before, 0
    for r in candidates:
        if len(chosen) >= kmax:
            break
        if moved_kv + r.length > room:
            continue
        chosen.append(r.sample_id)
        moved_kv += r.length
        k = len(chosen)
        total = cost.throughput(l.running - k, l.kv_used - moved_kv) + cost.throughput(s.running + k, s.kv_used + moved_kv)
        if total > best_total:
            best_total, best_k = total, k
    if best_k == 0 or best_total < before * (1.0 + min_gain):
        return ()
    return tuple(chosen[:best_k])


def engine_should_interrupt_preempted(waiting_after_preemption: int, phi_wait: int | None) -> bool:
    """Engine-side migration rule (φ_wait): a sample the engine just preempted is interrupted
    back to the central queue (to be re-routed anywhere) instead of waiting on this engine
    when the engine's waiting queue — counting the preempted sample — exceeds φ_wait.
    `None` disables the rule (the sample waits, as in plain vLLM)."""
    return phi_wait is not None and waiting_after_preemption > phi_wait
