"""Coordinator policies (docs/coordinator.md, policies and baselines) as configurations of the strategy functions.

| policy | routing | synchronization | migration | staleness bound |
|---|---|---|---|---|
| `sync` (veRL) | request count | all pull together once idle (no partial rollout) | none | η = 0 |
| `one_step` (veRL-Pipeline) | request count | all pull together once idle | none | η = 1 |
| `strict` (veRL-Async / AReaL / ROLL Flash) | request count; an interrupted sample resumes on its instance | greedy: interrupt and pull as soon as behind | none | the run's η |
| `staleflow` | multi-level queue + waterfall (μ) | status-based (KV threshold) | ψ (coordinator) + φ_wait (engine) | the run's η |

Ablations change one ingredient of `staleflow`: `staleflow-naive-route` (request-count
routing), `staleflow-greedy-pull` (pull as soon as behind), `staleflow-no-migration`
(neither ψ nor φ_wait). Every parameter (μ, ψ, φ_wait, KV threshold, cycle period) can be
overridden: `get_policy("staleflow", mu=0.3)`.

`Policy.plan` runs one coordinator cycle's decisions — routing, then synchronization, then
migration, each seeing the previous one's decisions — and is pure like the strategies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .cost_model import CostModel
from .state import InstanceView, QueuedSample
from .strategies import (
    Admission,
    AlwaysAdmit,
    InterruptDecision,
    PullDecision,
    RouteDecision,
    apply_pulls,
    apply_routes,
    finishing_oldest,
    migrate_throughput_ratio,
    queue_levels,
    routable_versions,
    route_request_count,
    route_waterfall,
    stagger_pulls,
    sync_all_idle,
    sync_greedy,
    sync_status_based,
)

ROUTINGS = ("waterfall", "request_count")
SYNCS = ("status", "greedy", "all_idle")


@dataclass(frozen=True)
class CyclePlan:
    routes: list[RouteDecision] = field(default_factory=list)
    pulls: list[PullDecision] = field(default_factory=list)
    interrupts: list[InterruptDecision] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.routes or self.pulls or self.interrupts)


@dataclass(frozen=True)
class Policy:
    name: str
    routing: str = "waterfall"
    sync: str = "status"
    migration: bool = True  # coordinator-side ψ migration
    engine_migration: bool = True  # engine-side φ_wait rule
    eta: int | None = None  # a forced staleness bound (sync: 0, one_step: 1); None: the run's
    mu: float = 0.25  # waterfall: route only if ΔT >= μ·T(1, l)   (0.2-0.3 in the reference runs)
    psi: float = 2.0  # migration: loaded throughput > ψ · starved throughput
    phi_wait: int = 1  # engine: interrupt a preempted sample when the waiting queue exceeds this
    kv_threshold: float = 0.3  # status-based pull only at or below this KV usage
    pull_for_new_work: bool = True  # status-based: a busy instance pulls only when new-version work waits
    keep_oldest: bool = True  # status-based: an instance finishing the oldest in-flight samples does not pull
    keep_horizon: float = 30.0  # keep_oldest: ... if they end within this many seconds at the most
    pull_depth: int | None = 2  # status-based: pulls in flight per PS stream (strategies.stagger_pulls; None: off)
    cycle_period: float = 0.1  # seconds between coordinator cycles
    block_scope: str = "instance"  # see strategies.route_waterfall
    max_requests: int | None = None  # request-count routing: cap per instance (None: its max_running)
    sticky_resume: bool = False  # request-count routing: interrupted samples resume where they ran
    min_migrate_running: int = 2
    migrate_min_gain: float = 0.15  # migrate only if the pair's cost-model T rises this much (docs/policies.md)

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r} not in {ROUTINGS}")
        if self.sync not in SYNCS:
            raise ValueError(f"sync {self.sync!r} not in {SYNCS}")
        if self.cycle_period <= 0:
            raise ValueError("cycle_period must be > 0")

    def effective_eta(self, eta: int) -> int:
        return self.eta if self.eta is not None else eta

    @property
    def phi(self) -> int | None:
        """φ_wait for the engines, or None when the engine-side rule is off."""
        return self.phi_wait if self.engine_migration else None

    @property
    def reads_running_samples(self) -> bool:
        """Whether its cycle reads the per-sample details of the running samples (the samples
        migration moves, the ones `keep_oldest` waits for), which snapshots may then omit."""
        return self.migration or (self.sync == "status" and self.keep_oldest)

    def with_params(self, **overrides: Any) -> Policy:
        return replace(self, **overrides)

    def plan(
        self,
        instances: Sequence[InstanceView],
        queued: Iterable[QueuedSample],
        cost: CostModel,
        *,
        ps_version: int,
        admission: Admission | None = None,
        group_versions: Mapping[int, int] | None = None,
        max_response: int | None = None,
        pull_streams: int | None = None,
    ) -> CyclePlan:
        admission = admission or AlwaysAdmit()
        queued = list(queued)
        levels = queue_levels(queued, group_versions)
        pulls: list[PullDecision] = []
        instances = list(instances)
        if self.sync == "greedy":
            # greedy pulls do not depend on the queue: decide them first, so that nothing is
            # routed onto an instance that is about to drop it
            pulls = sync_greedy(instances, ps_version)
            if pulls:
                instances = apply_pulls(instances, pulls)
        if self.routing == "waterfall":
            routes = route_waterfall(
                instances,
                queued,
                cost,
                admission,
                mu=self.mu,
                group_versions=group_versions,
                block_scope=self.block_scope,
                levels=levels,
            )
        else:
            routes = route_request_count(
                instances,
                queued,
                admission,
                group_versions=group_versions,
                max_requests=self.max_requests,
                levels=levels,
                sticky=self.sticky_resume,
            )
        routed: set[int] = set()
        if routes:
            routed = {r.sample_id for r in routes}
            by_id = {s.sample_id: s for s in queued if s.sample_id in routed}
            after = apply_routes(instances, routes, by_id)
        else:
            after = instances
        behind = any(i.version < ps_version and not i.pulling for i in after)
        need_routable = (self.sync != "greedy" and behind) or self.migration
        routable: Mapping[int, bool] = {}
        if need_routable:
            versions = [i.version for i in after]
            if self.sync == "status" and self.pull_for_new_work and behind:
                versions.append(ps_version)
            routable = routable_versions(versions, None, admission, group_versions, levels=levels, exclude=routed)
        if self.sync != "greedy" and behind:
            # an instance that just received work at its current version keeps it this cycle
            got_work = {r.instance_id for r in routes}
            candidates = [i for i in after if i.instance_id not in got_work]
            if self.sync == "status":
                new_work = routable.get(ps_version, False) if self.pull_for_new_work else None
                pulls = sync_status_based(
                    candidates,
                    ps_version,
                    routable,
                    kv_threshold=self.kv_threshold,
                    new_work=new_work,
                    keep=finishing_oldest(after, cost, max_response, self.keep_horizon) if self.keep_oldest else (),
                )
                if self.pull_depth is not None:
                    pulls = stagger_pulls(after, pulls, pull_streams, self.pull_depth)
            elif not got_work:
                pulls = sync_all_idle(after, ps_version, routable)
        interrupts: list[InterruptDecision] = []
        if self.migration:
            if pulls and self.sync != "greedy":
                after = apply_pulls(after, pulls)
            interrupts = migrate_throughput_ratio(
                after,
                routable,
                cost,
                psi=self.psi,
                min_running=self.min_migrate_running,
                min_gain=self.migrate_min_gain,
            )
        return CyclePlan(routes, pulls, interrupts)


_BASE: dict[str, Policy] = {
    "sync": Policy("sync", routing="request_count", sync="all_idle", migration=False, engine_migration=False, eta=0),
    "one_step": Policy(
        "one_step", routing="request_count", sync="all_idle", migration=False, engine_migration=False, eta=1
    ),
    "strict": Policy(
        "strict", routing="request_count", sync="greedy", migration=False, engine_migration=False, sticky_resume=True
    ),
    "staleflow": Policy("staleflow"),
    "staleflow-naive-route": Policy("staleflow-naive-route", routing="request_count"),
    "staleflow-greedy-pull": Policy("staleflow-greedy-pull", sync="greedy"),
    "staleflow-no-migration": Policy("staleflow-no-migration", migration=False, engine_migration=False),
}

BASELINES = ("sync", "one_step", "strict", "staleflow")
ABLATIONS = ("staleflow-naive-route", "staleflow-greedy-pull", "staleflow-no-migration")
POLICY_NAMES = tuple(_BASE)
TUNABLE = tuple(
    f.name for f in fields(Policy) if f.name not in ("name", "routing", "sync", "migration", "engine_migration", "eta")
)


def get_policy(name: str | Policy, **overrides: Any) -> Policy:
    """A named policy with the reference defaults, optionally with some parameters changed."""
    if isinstance(name, Policy):
        return name.with_params(**overrides) if overrides else name
    if name not in _BASE:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    p = _BASE[name]
    return p.with_params(**overrides) if overrides else p
