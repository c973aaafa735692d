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
            n1 = c.n[cols][None, :] + 1
            return n1 / cost.latency_array(n1, c.kv[cols][None, :] + L[rows, None]) - c.T[cols][None, :]

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
