"""Routing strategies (docs/coordinator.md): queue levels, waterfall and request-count routing.

* `route_waterfall`: multi-level queue by version (oldest level first; a level that cannot be
  fully routed blocks newer levels this cycle) and, per sample, the instance with the largest
  marginal throughput gain ΔT_i = T(n_i+1, kv_i+l) - T(n_i, kv_i) among those that may run
  it, routed only if ΔT_i >= μ·T(1, l). Naive form: `route_request_count`.
* `routable_versions`: which instance versions could still take some queued sample (read by
  synchronization and migration).

Pure functions, like the rest of the strategies (see `strategies`).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .admission import Admission, AlwaysAdmit
from .cost_model import CostModel
from .state import InstanceView, QueuedSample

NEW_LEVEL = math.inf  # level of samples of groups not yet in flight: the newest work


# ---- decisions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteDecision:
    sample_id: int
    instance_id: int


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
    for s in queued:
        key = level_of(s, group_versions)
        lst = levels.get(key)
        if lst is None:
            levels[key] = [s]
        else:
            lst.append(s)
    return sorted(levels.items(), key=lambda kv: kv[0])


Levels = list[tuple[float, list[QueuedSample]]]


# ---- routing ---------------------------------------------------------------------------------


class _Cluster:
    """The instances as numpy arrays (for scoring blocks of samples) and as Python lists (for
    the per-route updates, which numpy scalars would slow down); both updated per route."""

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
        self.lists = [
            a.tolist() for a in (self.version, self.n, self.kv, self.cap, self.max_running, self.T, self.vidx)
        ]

    def add(self, j: int, length: float) -> None:
        """One more running sample of `length` KV tokens on instance j."""
        _, n, kv, _, _, T, _ = self.lists
        n[j] += 1.0
        kv[j] += length
        T[j] = self.cost.throughput(n[j], kv[j])
        self.n[j], self.kv[j], self.T[j] = n[j], kv[j], T[j]


# rows x instances scored at most at once (the block grows to this while nothing routes)
_BLOCK_ELEMENTS = 1 << 16


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


class _LevelAdmission:
    """Admission answers (per version) for one level's samples, asked when a row is scored.

    With a keyed oracle outside the newest level the answers are taken once, at the level's
    start (its routes are joins of in-flight groups). Otherwise they are asked afresh after
    every commit (a reservation changes the buffer counters), once per key class between
    commits: what the full-matrix form recomputed for every remaining row after each route,
    only for the rows actually scored."""

    def __init__(self, samples: Sequence[QueuedSample], admission: Admission, versions: Sequence[int], fixed: bool):
        self.samples, self.admission, self.versions = samples, admission, versions
        self.keyf = getattr(admission, "key", None)
        self.fixed = _admission_rows(samples, admission, versions) if fixed else None
        self.memo: dict = {}

    def row(self, q: int) -> tuple[bool, ...]:
        if self.fixed is not None:
            return tuple(self.fixed[q].tolist())
        s = self.samples[q]
        if self.keyf is None:
            return tuple(self.admission.admits(s, v) for v in self.versions)
        k = self.keyf(s)
        row = self.memo.get(k)
        if row is None:
            row = self.memo[k] = tuple(self.admission.admits(s, v) for v in self.versions)
        return row

    def rows(self, q0: int, q1: int) -> np.ndarray:
        if self.fixed is not None:
            return self.fixed[q0:q1]
        return np.array([self.row(q) for q in range(q0, q1)], dtype=bool).reshape(q1 - q0, len(self.versions))

    def committed(self) -> None:
        if self.fixed is None:
            self.memo.clear()


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
    """Multi-level queue + waterfall (docs/coordinator.md).

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

    The result equals routing samples one by one in that order; the work stays bounded at
    scale (docs/coordinator.md, "Scale"). After a route only one instance changed, so the
    next sample, when alike (same length, version floor and admission answers, as a group's
    members are), is scored by updating one entry of the previous sample's scores; any other
    sample is scored against all instances at once. While nothing routes nothing changes, so
    samples are scored in blocks [rows x instances] that double while nothing routes: from
    32 rows at a level's start, from one row after a route. A cycle costs
    O(instances) numpy work per route and per unlike sample, plus O(samples x instances) for
    the ones that wait; never the [samples x instances] matrix per route.
    """
    admission = admission or AlwaysAdmit()
    if not instances:
        return []
    if levels is None:
        levels = queue_levels(queued, group_versions)
    c = _Cluster(instances, cost)
    version, _, kv, cap, _, T, vidx = c.lists
    blocked = np.zeros(len(c.ids), dtype=bool)
    keyed = hasattr(admission, "key")
    max_block = max(1, _BLOCK_ELEMENTS // len(c.ids))
    routes: list[RouteDecision] = []
    for level, samples in levels:
        base = c.open & ~blocked & (c.waiting == 0) & (c.n < c.max_running)
        if not base.any():
            break
        if level == NEW_LEVEL and not any(admission.admits(samples[0], v) for v in c.versions):
            # every member of the newest level is a never-routed member of a group not yet in
            # flight: when one cannot reserve at any version, none can (the budget is full)
            break
        m = len(samples)
        L = np.array([s.length for s in samples], dtype=float)
        need = np.array([s.min_instance_version for s in samples], dtype=np.int64)
        Ll, needl = L.tolist(), need.tolist()
        adm = _LevelAdmission(samples, admission, c.versions, fixed=keyed and level != NEW_LEVEL)
        thresh = mu * cost.throughput_array(np.ones(m), L)  # μ·ΔT_ideal, ΔT_ideal = T(1, l)
        threshl = thresh.tolist()

        def scores(q0: int, q1: int, arows: np.ndarray) -> np.ndarray:
            Lb = L[q0:q1, None]
            feasible = (
                base[None, :]
                & (c.version[None, :] >= need[q0:q1, None])
                & (c.kv[None, :] + Lb <= c.cap[None, :])
                & arows[:, c.vidx]
            )
            n1 = c.n[None, :] + 1
            gain = n1 / cost.latency_array(n1, c.kv[None, :] + Lb) - c.T[None, :]
            return np.where(feasible, gain, -np.inf)

        def score_one(q: int, arow: tuple[bool, ...]) -> np.ndarray:
            # `scores` for one row, on 1-d arrays and skipping the masks that pass everywhere:
            # the same elementwise arithmetic, so the same values
            kvl = c.kv + Ll[q]
            feasible = base & (kvl <= c.cap)
            if needl[q] > c.versions[0]:
                feasible &= c.version >= needl[q]
            if not all(arow):
                feasible &= np.array(arow, dtype=bool)[c.vidx]
            n1 = c.n + 1
            return np.where(feasible, n1 / cost.latency_array(n1, kvl) - c.T, -np.inf)

        failed_need: int | None = None
        # (signature, scores) of the latest routed sample, brought up to date after its route
        cached: tuple[tuple, np.ndarray] | None = None
        q0, size = 0, min(32, max_block)
        while q0 < m:
            if size == 1:  # one sample: typically the one after a route
                arow = adm.row(q0)
                sig = (Ll[q0], needl[q0], arow)
                row = cached[1] if cached is not None and cached[0] == sig else score_one(q0, arow)
                j = int(row.argmax())
                q = q0 if row[j] >= threshl[q0] else q0 + 1
                q1 = q0 + 1
            else:  # nothing routed lately: a block, up to its first routable row
                q1 = min(m, q0 + size)
                score = scores(q0, q1, adm.rows(q0, q1))
                passing = score >= thresh[q0:q1, None]
                hits = np.flatnonzero(passing.any(axis=1))
                q = q0 + int(hits[0]) if len(hits) else q1
                if q < q1:
                    row = score[q - q0]
                    j = int(np.where(passing[q - q0], row, -np.inf).argmax())
                    arow = adm.row(q)
            if q > q0:  # rows q0..q-1 could not be routed (state unchanged since)
                fneed = min(needl[q0:q])
                failed_need = fneed if failed_need is None else min(failed_need, fneed)
            if q >= q1:
                q0, size = q1, min(2 * size, max_block)
                continue
            s = samples[q]
            admission.commit(s, version[j])
            adm.committed()
            routes.append(RouteDecision(s.sample_id, c.ids[j]))
            c.add(j, Ll[q])
            if c.n[j] >= c.max_running[j]:
                base[j] = False
            # only column j changed: its entry again, with the same arithmetic (same rounding)
            row = row.copy()
            n1 = c.lists[1][j] + 1.0
            ok = base[j] and version[j] >= needl[q] and kv[j] + Ll[q] <= cap[j] and arow[vidx[j]]
            row[j] = n1 / cost.latency(n1, kv[j] + Ll[q]) - T[j] if ok else -np.inf
            cached = ((Ll[q], needl[q], arow), row)
            q0, size = q + 1, 1
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
