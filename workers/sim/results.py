"""Simulation results: `SimResult` and its computation from a finished `Simulator`."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .setups import Setup
from .workload import Workload

if TYPE_CHECKING:
    from .simulator import Simulator


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SimResult:
        """The inverse of `to_dict` (JSON turns histogram keys into strings)."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for h in ("staleness_hist", "sample_staleness_hist"):
            kw[h] = {int(k): v for k, v in kw[h].items()}
        return cls(**kw)


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


def build_result(sim: Simulator, steps: int, wall0: float) -> SimResult:
    """Summarise `sim` after `Simulator.run` asked for `steps` steps (started at `wall0`)."""
    p, su, tr = sim.p, sim.setup, sim.trainer
    done = p.version
    T = tr.publish_times[-1] if tr.publish_times else sim.now
    for e in sim.engines.values():  # bring lazily advanced engines to the end time
        e.advance(sim.now)
    tokens = sum(tr.step_tokens[:done])
    samples = sum(tr.step_samples[:done])
    warm = min(max(1, done // 5), max(done - 1, 0))
    if done > warm and warm > 0:
        span = tr.publish_times[done - 1] - tr.publish_times[warm - 1]
        st_tokens = sum(tr.step_tokens[warm:done])
        st_samples = sum(tr.step_samples[warm:done])
        steady_tps = st_tokens / span if span > 0 else 0.0
        steady_sps = st_samples / span if span > 0 else 0.0
    else:
        steady_tps = tokens / T if T > 0 else 0.0
        steady_sps = samples / T if T > 0 else 0.0
    inst_time = sum(e.t for e in sim.engines.values()) or 1.0
    idle = sum(e.idle for e in sim.engines.values())
    pull = sum(e.pull_total for e in sim.engines.values())
    ideal = ideal_tokens_per_s(su, sim.seed)
    violations = list(dict.fromkeys(sim.violations + p.check_invariants()))
    step_times = [b - a for a, b in zip([0.0] + tr.publish_times[:-1], tr.publish_times)]
    steady_from = tr.publish_times[warm - 1] if warm > 0 and len(tr.publish_times) >= warm else 0.0
    return SimResult(
        setup=su.name,
        policy=sim.policy.name,
        eta=sim.eta,
        steps=done,
        seed=sim.seed,
        completed=done >= steps,
        virtual_time=T,
        wall_time=time.perf_counter() - wall0,
        trained_tokens=tokens,
        trained_prompt_tokens=tr.trained_prompt_tokens,
        trained_samples=samples,
        trained_groups=sum(tr.staleness.values()),
        tokens_per_s=tokens / T if T > 0 else 0.0,
        samples_per_s=samples / T if T > 0 else 0.0,
        steady_tokens_per_s=steady_tps,
        steady_samples_per_s=steady_sps,
        warmup_steps=warm,
        ideal_tokens_per_s=ideal,
        ratio_to_ideal=steady_tps / ideal if ideal else 0.0,
        rollout_idle_fraction=idle / inst_time,
        rollout_pull_fraction=pull / inst_time,
        trainer_idle_fraction=max(0.0, 1.0 - tr.busy / T) if T > 0 else 1.0,
        staleness_hist=dict(sorted(tr.staleness.items())),
        sample_staleness_hist=dict(sorted(tr.sample_staleness.items())),
        step_times=step_times,
        train_times=list(tr.train_times[:done]),
        generated_tokens=sum(e.tokens for e in sim.engines.values()),
        prefill_tokens=int(sum(e.prefill_tokens for e in sim.engines.values())),
        commands=dict(sim.commands) | {"preemptions": sum(e.preemptions for e in sim.engines.values())},
        cycles=sim.cycles,
        coordinator_wall_s=sim.coord_wall,
        snapshots={"accepted": sim.spec.accepted, "dropped": sim.spec.dropped},
        invariant_violations=violations,
        route_refusals=sim.route_refusals,
        extra=regime_shares(sim.regime_log, steady_from, T) | {"regime_switches": sim.spec.regime.switches},
    )


def regime_shares(log: list[tuple[float, str, str, bool]], start: float, end: float) -> dict[str, Any]:
    """Time shares over [start, end] of the coordinator's regime estimate and of its per-cycle
    labels, and the share of time the trainer waited for a buffer with a sample in the queue."""
    est: dict[str, float] = {}
    lab: dict[str, float] = {}
    gating = total = 0.0
    for (t0, regime, label, gq), (t1, *_) in zip(log, log[1:] + [(end, "", "", False)]):
        w = min(t1, end) - max(t0, start)
        if w <= 0:
            continue
        total += w
        est[regime] = est.get(regime, 0.0) + w
        lab[label] = lab.get(label, 0.0) + w
        gating += w * gq
    total = total or 1.0
    return {
        "regime_share": {k: v / total for k, v in sorted(est.items())},
        "label_share": {k: v / total for k, v in sorted(lab.items())},
        "trainer_waits_on_queued": gating / total,
    }
