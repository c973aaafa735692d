"""One coordinator cycle: plan on the speculative state, apply, feed the commands back.

The live service (`service.Coordinator`) and the simulator (`workers.sim.simulator`) both run
their cycles through `run_cycle`, so the simulator measures exactly the decision code that runs
in production. What differs between them is only where the commands go and where the inputs
come from: the service reads a database snapshot and writes through the data layer `Protocol`
in one fenced transaction; the simulator reads its in-process protocol and drives its engines.
That side is the `apply` callable; everything else is here, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .admission import Admission
from .cost_model import CostModel
from .policies import CyclePlan, Policy
from .regime import classify, observe_cycle
from .state import QueuedSample, SpeculativeState


@dataclass(frozen=True)
class Applied:
    """What the side effects made of a plan, in the plan's order."""

    routed: Sequence[bool]  # per plan.routes: accepted by the protocol (refused: speculation was off)
    interrupted: Sequence[Sequence[int]]  # per plan.interrupts: the samples actually interrupted
    at: float  # when the commands took effect, on the clock the speculative state runs on


# Carries out a plan (routes, pulls, interrupts); None when nothing was applied (e.g. the
# coordinator was deposed while writing), so that the speculative state stays as it was.
Apply = Callable[[CyclePlan], Applied | None]


@dataclass(frozen=True)
class CycleOutcome:
    plan: CyclePlan
    applied: Applied | None
    decide_s: float  # real seconds spent in Policy.plan

    @property
    def refused(self) -> int:
        return sum(not ok for ok in self.applied.routed) if self.applied else 0


def run_cycle(
    policy: Policy,
    cost: CostModel,
    spec: SpeculativeState,
    queued: Iterable[QueuedSample],
    apply: Apply,
    *,
    ps_version: int,
    admission: Admission,
    group_versions: Mapping[int, int],
    max_response: int | None = None,
    pull_streams: int | None = None,
    now: float | None = None,
) -> CycleOutcome:
    """Decide one cycle's routes, pulls and interrupts, `apply` them, and record in `spec` what
    was applied (routes the protocol accepted, the samples actually interrupted) at `Applied.at`.

    With `now` (the clock the speculative state runs on) the cycle also folds what it sees into
    `spec.regime`, the estimate of which resource binds (regime.py)."""
    queued = list(queued)
    t0 = time.perf_counter()
    if now is not None:
        signals = observe_cycle(spec.views(copy=False), admission, ps_version)
        if signals is not None:
            spec.regime_label = classify(signals)
            spec.regime = spec.regime.update(spec.regime_label, now, version=ps_version)
    # the live estimates, not copies: the strategies never modify their inputs
    plan = policy.plan(
        spec.views(copy=False),
        queued,
        cost,
        ps_version=ps_version,
        admission=admission,
        group_versions=group_versions,
        max_response=max_response,
        pull_streams=pull_streams,
    )
    decide_s = time.perf_counter() - t0
    applied = apply(plan)
    if applied is not None:
        now = applied.at
        if plan.routes:
            length = {q.sample_id: q.length for q in queued}
            for r, ok in zip(plan.routes, applied.routed):
                if ok:
                    spec.on_route(r.instance_id, length[r.sample_id], now)
        for p in plan.pulls:
            spec.on_pull(p.instance_id, p.version, now)
        for it, got in zip(plan.interrupts, applied.interrupted):
            spec.on_interrupt(it.instance_id, got, now)
    return CycleOutcome(plan, applied, decide_s)
