"""Coordinator strategies (docs/coordinator.md) as pure functions.

Inputs: instance views (the speculative state), queued samples, the cost model, an
admission oracle and parameters. Outputs: lists of decisions. No I/O and no clock reads;
strategies update private copies of the views as they decide, never the caller's objects.

* Routing — `route_waterfall` / `route_request_count`, with queue levels and `apply_routes`:
  in `routing` (re-exported here).
* Admission — `AdmissionView`, `CallbackAdmission`, `AlwaysAdmit`: in `admission`
  (re-exported here).
* Synchronization — `sync_status_based`: pull only when behind the PS, nothing waiting,
  nothing routable at the current version and KV usage at or below a threshold. Naive forms:
  `sync_greedy` (pull as soon as behind) and `sync_all_idle` (whole-batch version, no partial
  rollout: everyone pulls together once all are idle).
* Migration — `migrate_throughput_ratio` (coordinator side, ψ, one per cycle) and
  `engine_should_interrupt_preempted` (engine side, φ_wait: called by the simulator's batch
  model and by the rollout worker on a `PreemptedEvent`; defined beside the engine interface,
  workers/rollout/engines/base.py, and re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from workers.rollout.engines.base import engine_should_interrupt_preempted

from .admission import Admission, AdmissionView, AlwaysAdmit, CallbackAdmission
from .cost_model import CostModel
from .routing import (
    NEW_LEVEL,
    Levels,
    RouteDecision,
    apply_routes,
    level_of,
    queue_levels,
    routable_versions,
    route_request_count,
    route_waterfall,
)
from .state import InstanceView

__all__ = [
    "NEW_LEVEL",
    "Admission",
    "AdmissionView",
    "AlwaysAdmit",
    "CallbackAdmission",
    "InterruptDecision",
    "Levels",
    "PullDecision",
    "RouteDecision",
    "apply_pulls",
    "apply_routes",
    "engine_should_interrupt_preempted",
    "level_of",
    "migrate_throughput_ratio",
    "queue_levels",
    "routable_versions",
    "route_request_count",
    "route_waterfall",
    "sync_all_idle",
    "sync_greedy",
    "sync_status_based",
    "stagger_pulls",
    "oldest_running_version",
    "finishing_oldest",
]


# ---- decisions (routes: `RouteDecision`, in routing) -------------------------------------------


@dataclass(frozen=True)
class PullDecision:
    instance_id: int
    version: int  # the version to load (the PS's latest)


@dataclass(frozen=True)
class InterruptDecision:
    instance_id: int
    sample_ids: tuple[int, ...]
    reason: str = "migration"


# ---- synchronization -------------------------------------------------------------------------


def sync_status_based(
    instances: Sequence[InstanceView],
    ps_version: int,
    routable: Mapping[int, bool] | Callable[[int], bool],
    *,
    kv_threshold: float = 0.3,
    new_work: bool | None = None,
    keep: Container[int] = (),
) -> list[PullDecision]:
    """Pull instance i only when it is behind the PS, its waiting queue is empty, no queued
    sample can still be routed to it at its current version, and its KV usage is at or below
    `kv_threshold` (docs/coordinator.md). Staying on an old version while old work remains is safe.

    `new_work`: whether some queued sample could be routed at `ps_version`. When it is False
    an instance that still runs samples keeps them: a pull would interrupt them (their
    re-prefill and the pull are lost) and gain nothing, as no work waits for the new version
    (the staleness budget is full); it pulls once empty, or once new work appears. None: not
    known (the rule is off).

    `keep`: instances that do not pull now (`finishing_oldest`: they are about to finish the
    samples the next buffer waits for)."""
    is_routable = routable if callable(routable) else (lambda v: routable.get(v, False))
    pulls = []
    for i in instances:
        if i.pulling or i.version >= ps_version or i.waiting > 0:
            continue
        if is_routable(i.version):
            continue
        if i.kv_usage > kv_threshold:
            continue
        if new_work is False and i.running > 0:
            continue
        if i.instance_id in keep:
            continue
        pulls.append(PullDecision(i.instance_id, ps_version))
    return pulls


def oldest_running_version(instances: Sequence[InstanceView]) -> int | None:
    """The smallest V_traj among the trajectories the views list, decoding or between turns
    (None: none listed)."""
    return min((r.v_traj for i in instances for r in i.running_samples), default=None)


def finishing_oldest(
    instances: Sequence[InstanceView], cost: CostModel, max_response: int | None, horizon: float
) -> set[int]:
    """Instances whose decoding samples of the oldest V_traj all end their turn within
    `horizon` seconds at the most: the decode part of `cost.remaining` for (max_response -
    tokens of the current turn) at the instance's current iteration time (`max_response` caps
    one turn; a single-turn sample's turn is its response).

    Those samples hold back the next buffer, so the trainer. A pull would interrupt them: their
    re-prefill, the pull and, under a shared PS, the other pulls' queue would all be added to
    the trainer's wait, to save at most `horizon` seconds of a lightly loaded instance. A
    sample that may still run long (a long-tailed workload) is interrupted as before: keeping
    an instance on it would idle most of the instance for minutes. A trajectory waiting for its
    environment between turns keeps nothing: it holds no decode slot, so a pull costs it its
    prefix cache only and overlaps its wait. No bound without `max_response` (None): nothing
    is kept."""
    oldest = oldest_running_version(instances)
    if oldest is None or max_response is None:
        return set()
    keep = set()
    for i in instances:
        old = [r for r in i.running_samples if r.v_traj <= oldest and r.env_since is None]
        if old and i.running:
            if all(
                cost.remaining(i.running, i.kv_used, max_response - r.current_turn_tokens).decode_s <= horizon
                for r in old
            ):
                keep.add(i.instance_id)
    return keep


def stagger_pulls(
    instances: Sequence[InstanceView], pulls: Sequence[PullDecision], streams: int | None, depth: int = 1
) -> list[PullDecision]:
    """At most `depth` pulls in flight per PS stream (`streams`: the pulls the PS's egress carries
    at full rate); the rest wait for a later cycle. Instances that pull together share the
    egress and all idle until the last transfer ends, while one whose pull is deferred keeps
    decoding what it runs. `depth` 2: a pull holds its stream for its transfer, not its
    reload, and the views show the whole pull, so one more pull per stream waits at most one
    transfer and keeps the egress busy. Those with the least work (running samples, then KV)
    pull first, as a pull interrupts it. `streams` None: no limit (the PS's capacity unknown)."""
    if streams is None or not pulls:
        return list(pulls)
    free = depth * streams - sum(1 for i in instances if i.pulling)
    if free >= len(pulls):
        return list(pulls)
    if free <= 0:
        return []
    by_id = {i.instance_id: i for i in instances}
    order = sorted(pulls, key=lambda p: (by_id[p.instance_id].running, by_id[p.instance_id].kv_used, p.instance_id))
    return order[:free]


def sync_greedy(instances: Sequence[InstanceView], ps_version: int) -> list[PullDecision]:
    """Naive: pull (interrupting whatever runs) as soon as a newer version exists."""
    return [PullDecision(i.instance_id, ps_version) for i in instances if not i.pulling and i.version < ps_version]


def sync_all_idle(
    instances: Sequence[InstanceView],
    ps_version: int,
    routable: Mapping[int, bool] | Callable[[int], bool],
) -> list[PullDecision]:
    """Whole-batch version, no partial rollout: once no instance runs, waits on anything or
    holds a trajectory between turns, and nothing is routable at its version, every instance
    behind the PS pulls together."""
    is_routable = routable if callable(routable) else (lambda v: routable.get(v, False))
    live = [i for i in instances if not i.pulling]
    if not any(i.version < ps_version for i in live):
        return []
    for i in live:
        if i.running or i.waiting or i.env_waiting or is_routable(i.version):
            return []
    return [PullDecision(i.instance_id, ps_version) for i in live if i.version < ps_version]


def apply_pulls(instances: Sequence[InstanceView], pulls: Sequence[PullDecision]) -> list[InstanceView]:
    by_id = {p.instance_id: p for p in pulls}
    out = []
    for i in instances:
        i = i.copy()
        p = by_id.get(i.instance_id)
        if p is not None:
            i.running = i.waiting = i.kv_used = i.env_waiting = 0
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
    """Coordinator-side migration, at most one per cycle (docs/coordinator.md).

    Trigger: a starved instance (not pulling, nothing waiting, nothing routable at its
    version) whose throughput is less than 1/ψ of a loaded instance's (same or older version,
    so the starved one may continue the loaded one's samples). T is the cost model's
    T(n, kv), or the measured throughput with `use_measured`.

    `running`, `kv_used` and the candidates to move are decoding samples only: trajectories
    waiting for their environment between turns are no decode load (cost_model.Remaining).

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
    loaded = sorted(((thr(ld), ld) for ld in live if ld.running >= min_running), key=lambda x: -x[0])
    if not loaded:
        return []
    starved_t = sorted(((thr(s), s) for s in starved), key=lambda x: x[0])
    if loaded[0][0] <= psi * starved_t[0][0]:
        return []  # no pair passes the ψ trigger
    for s, ld in _ranked_pairs(starved_t, loaded, psi, max_tries):
        ids = _best_move(s, ld, cost, min_gain)
        if ids:
            return [InterruptDecision(ld.instance_id, ids, "migration")]
    return []


def _ranked_pairs(
    starved_t: Sequence[tuple[float, InstanceView]],
    loaded: Sequence[tuple[float, InstanceView]],
    psi: float,
    limit: int,
) -> list[tuple[InstanceView, InstanceView]]:
    """The `limit` best (starved, loaded) pairs that pass the ψ trigger: by T ratio, then the
    loaded one's T, highest first; ties in the order (starved ascending by T, loaded descending).

    The [starved x loaded] comparison is one numpy matrix: when a batch's tail leaves most of a
    320-instance cluster starved, the pairs number tens of thousands, too many for a Python loop
    and sort within a cycle (docs/coordinator.md, "Scale")."""
    ts = np.array([t for t, _ in starved_t], dtype=float)[:, None]
    tl = np.array([t for t, _ in loaded], dtype=float)[None, :]
    sv, lv = [i for _, i in starved_t], [i for _, i in loaded]

    def col(views: Sequence[InstanceView], attr: str) -> np.ndarray:
        return np.array([getattr(i, attr) for i in views], dtype=np.int64)

    ok = (
        (tl > psi * ts)
        & (col(lv, "instance_id")[None, :] != col(sv, "instance_id")[:, None])
        & (col(lv, "version")[None, :] <= col(sv, "version")[:, None])
        & (col(lv, "running")[None, :] - col(sv, "running")[:, None] >= 2)
    )
    si, li = np.nonzero(ok)  # row-major: the order of a loop over starved, then loaded
    if not len(si):
        return []
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(ts[si, 0] <= 0, np.inf, tl[0, li] / ts[si, 0])
    order = np.lexsort((np.arange(len(si)), -tl[0, li], -ratio))[:limit]
    return [(sv[si[k]], lv[li[k]]) for k in order]


def _best_move(s: InstanceView, ld: InstanceView, cost: CostModel, min_gain: float) -> tuple[int, ...]:
    kmax = (ld.running - s.running) // 2
    room = s.kv_capacity - s.kv_used
    before = cost.throughput(ld.running, ld.kv_used) + cost.throughput(s.running, s.kv_used)
    # only decoding samples load `ld` (one between turns holds no slot: moving it gains nothing)
    candidates = sorted(
        (r for r in ld.running_samples if r.v_traj <= s.version and r.env_since is None),
        key=lambda r: (-r.tokens, r.sample_id),
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
        total = cost.throughput(ld.running - k, ld.kv_used - moved_kv) + cost.throughput(
            s.running + k, s.kv_used + moved_kv
        )
        if total > best_total:
            best_total, best_k = total, k
    if best_k == 0 or best_total < before * (1.0 + min_gain):
        return ()
    return tuple(chosen[:best_k])
