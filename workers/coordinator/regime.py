"""Which resource binds the run, estimated online from what the coordinator observes
(docs/policies.md, "The regime estimate").

Each cycle `observe` reduces the coordinator's inputs to `Signals` and `classify` names the
resource that binds at that instant:

* `trainer`  — a full buffer waits for the trainer: the rollout is ahead, the trainer sets the pace.
* `kv`       — engines hold work they cannot run (waiting queues) or their KV caches are nearly full.
* `budget`   — the staleness budget is full (no new group can reserve) while most admitted samples
               still decode: the rollout runs as much as the bound allows.
* `straggler`— the budget is full and most admitted samples have finished: the buffers wait for
               their groups' last samples.
* `open`     — none of these: budget free, caches with room, no ready buffer waiting.

`RegimeEstimate.update` turns the instantaneous labels into a stable estimate: a time-weighted
exponential average per label (time constant `tau`), and a switch only when another label's
average exceeds the current one's by `margin` and the current one has held for `min_dwell`
seconds. A fixed regime therefore never switches (its own average only rises); a clear change
switches after tau·ln(2 / (1 - margin)), about 0.9·tau (tests in
tests/unit/test_regime_estimate.py). Given the PS's version, tau spans at least a few training
steps, so that the phases inside one step do not count as changes. Pure: no clock reads, no
I/O; times are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # state.py holds the estimate: no runtime import back
    from .state import InstanceView

REGIMES = ("open", "trainer", "kv", "budget", "straggler")


@dataclass(frozen=True)
class Signals:
    """One cycle's observation (all of it available to the live coordinator too)."""

    ready_buffer: bool  # the next buffer the trainer consumes is already full
    budget_free: bool  # some new group could still reserve a buffer entry
    kv_usage: float  # mean KV usage of the instances not pulling
    engine_waiting: int  # samples waiting inside engines (they hold no running slot)
    decoding: int  # samples running on instances
    budgeted: int  # samples the staleness budget lets into flight: (η+1)·B·N


def observe(
    instances: Sequence[InstanceView],
    *,
    ready_buffer: bool,
    budget_free: bool,
    budgeted: int,
) -> Signals:
    live = [i for i in instances if not i.pulling]
    kv = sum(i.kv_usage for i in live) / len(live) if live else 0.0
    return Signals(
        ready_buffer=ready_buffer,
        budget_free=budget_free,
        kv_usage=kv,
        engine_waiting=sum(i.waiting for i in live),
        decoding=sum(i.running for i in live),
        budgeted=max(1, budgeted),
    )


def observe_cycle(instances: Sequence[InstanceView], admission: object, ps_version: int) -> Signals | None:
    """`Signals` from one cycle's inputs; None when the admission oracle cannot tell the
    budget's state (only `AdmissionView`, the protocol's counters, can)."""
    ready = getattr(admission, "next_buffer_ready", None)
    reserve = getattr(admission, "can_reserve", None)
    limits = getattr(admission, "limits", None)
    if ready is None or reserve is None or limits is None:
        return None
    budgeted = (limits.eta + 1) * limits.batch_size * limits.group_size
    return observe(instances, ready_buffer=ready(), budget_free=reserve(ps_version), budgeted=budgeted)


def classify(s: Signals, *, kv_high: float = 0.85, straggler_share: float = 0.3) -> str:
    """The label of one observation (see the module docstring)."""
    if s.ready_buffer:
        return "trainer"
    if s.engine_waiting > 0 or s.kv_usage >= kv_high:
        return "kv"
    if not s.budget_free:
        return "straggler" if s.decoding < straggler_share * s.budgeted else "budget"
    return "open"


@dataclass(frozen=True)
class RegimeEstimate:
    """A hysteretic estimate of the regime (see the module docstring); immutable, `update`
    returns the next one."""

    regime: str = "open"
    since: float = 0.0  # time of the latest switch
    at: float | None = None  # time of the latest update (None: none yet)
    scores: Mapping[str, float] = field(default_factory=lambda: {r: 0.0 for r in REGIMES})
    switches: int = 0
    version: int | None = None  # the PS's version at the latest update
    version_at: float | None = None  # when it was first seen
    step_s: float | None = None  # moving average of the time between versions (a training step)

    def update(
        self,
        label: str,
        now: float,
        *,
        version: int | None = None,
        tau: float = 120.0,
        steps: float = 4.0,
        margin: float = 0.2,
        min_dwell: float = 60.0,
    ) -> RegimeEstimate:
        """Fold the label observed at `now` (held since the previous update) into the averages.

        With `version` (the PS's), once a step time is known, the averages span `steps` training
        steps (instead of `tau` seconds) and a switch needs one step since the last (instead of
        `min_dwell`): within a step the binding side changes
        (the rollout waits for the trainer's publish, then the trainer for the rollout's last
        samples), and the estimate is about which one binds over steps."""
        if label not in REGIMES:
            raise ValueError(f"regime {label!r} not in {REGIMES}")
        est = self._stepped(version, now)
        if est.at is None:
            scores = {r: float(r == label) for r in REGIMES}
            return replace(est, regime=label, since=now, at=now, scores=scores)
        if est.step_s is not None:
            tau, min_dwell = steps * est.step_s, est.step_s
        dt = max(0.0, now - est.at)
        keep = math.exp(-dt / tau)
        scores = {r: keep * v + (1.0 - keep) * float(r == label) for r, v in est.scores.items()}
        best = max(REGIMES, key=lambda r: scores[r])
        if best != est.regime and scores[best] > scores[est.regime] + margin and now - est.since >= min_dwell:
            return replace(est, regime=best, since=now, at=now, scores=scores, switches=est.switches + 1)
        return replace(est, at=now, scores=scores)

    def _stepped(self, version: int | None, now: float) -> RegimeEstimate:
        """The step-time average after seeing `version` at `now`."""
        if version is None or version == self.version:
            return self
        step_s = self.step_s
        if self.version_at is not None and self.version is not None and version > self.version:
            step = (now - self.version_at) / (version - self.version)
            step_s = step if step_s is None else 0.7 * step_s + 0.3 * step
        return replace(self, version=version, version_at=now, step_s=step_s)
