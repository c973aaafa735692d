"""The `sim` engine: continuous batching on the cost-model clock, in real (scaled) time.

No model and no torch: each decode iteration of `n` running samples holding `kv` KV tokens
takes `latency(n, kv)` simulated seconds (SPEC §4 cost model), slept as `latency · time_scale`
wall seconds, so a real-service run of the whole system (API, coordinator, workers, trainer)
behaves like GPUs of that kind, faster. KV capacity, admission, preemption (most recently
admitted first) and interruption behave as in a real engine.

A sample's response length comes from its prompt: `encode_prompt` puts the group's median
length and the member spread into the first tokens (groups are correlated, members vary), and
the sample's seed picks its own draw, so every instance agrees on a sample's length.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from workers.coordinator.cost_model import CostModel, get_cost_model
from workers.rollout.engines.base import Engine, EngineStats, FinishedEvent, Partial, PreemptedEvent, TokensEvent
from workers.settings import sim_engine_settings

MAGIC = 7_777_777  # first prompt token of a sim prompt
TOKEN, LOGPROB = 1, -1.0  # what the sim "generates"


def encode_prompt(prompt_len: int, group_median: float, member_sigma: float) -> list[int]:
    """A prompt of `prompt_len` tokens carrying the group's length distribution."""
    head = [MAGIC, max(1, round(group_median)), round(member_sigma * 1000)]
    return head + [TOKEN] * max(0, prompt_len - len(head))


def target_length(prompt: Sequence[int], seed: int, max_len: int) -> int:
    """The sample's total response length: a log-normal draw keyed by its seed."""
    if len(prompt) < 3 or prompt[0] != MAGIC:
        median, sigma = 256.0, 0.8
    else:
        median, sigma = float(prompt[1]), prompt[2] / 1000
    u = int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=8).digest(), "big") / 2**64
    z = NormalDist().inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
    return int(min(max_len, max(1, round(median * math.exp(sigma * z)))))


@dataclass
class _Seq:
    sid: str
    context: int  # prompt + prefix tokens
    remaining: int  # tokens still to generate in this stretch
    reason: str  # how it ends when `remaining` reaches 0
    generated: int = 0
    admitted: int = -1

    @property
    def kv(self) -> int:
        return self.context + self.generated


@dataclass
class _Rate:
    window_s: float = 5.0
    events: list[tuple[float, int]] = field(default_factory=list)

    def add(self, now: float, n: int) -> None:
        self.events.append((now, n))
        while self.events and self.events[0][0] < now - self.window_s:
            self.events.pop(0)

    def per_s(self, now: float) -> float:
        recent = [n for t, n in self.events if t >= now - self.window_s]
        return sum(recent) / self.window_s if recent else 0.0


class SimEngine(Engine):
    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        kv_capacity_tokens: int = 200_000,
        max_running: int = 256,
        time_scale: float | None = None,
        version: int = 0,
        max_step_s: float = 0.05,
        pull_s: float | None = None,
        prefill_rate: float | None = None,
    ):
        env = sim_engine_settings()  # STALEFLOW_SIM_*, for what the caller leaves unset
        self.cost = cost or get_cost_model(env.model, env.parallelism)
        self.kv_capacity, self.max_running = kv_capacity_tokens, max_running
        # wall seconds per simulated second; 0.1 runs ten times faster than the GPUs modelled
        self.time_scale = env.time_scale if time_scale is None else time_scale
        self.max_step_s = max_step_s
        # simulated seconds to load new weights, and prefill tokens/s charged at each admission
        self.pull_s = env.pull_s if pull_s is None else pull_s
        self.prefill_rate = env.prefill_rate if prefill_rate is None else prefill_rate
        self._prefill_due = 0.0
        self._version = version
        self.running: list[_Seq] = []
        self.waiting: list[_Seq] = []
        self._admissions = 0
        self.preemptions = 0
        self.sim_time = 0.0
        self._rate = _Rate()

    @property
    def version(self) -> int:
        return self._version

    def add_request(self, sample_id, prompt_tokens, prefix_tokens=(), prefix_logprobs=(), max_new_tokens=256, seed=0):
        done = len(prefix_tokens)
        total = target_length(prompt_tokens, seed, done + max_new_tokens)
        remaining = max(0, total - done)
        reason = "length" if total >= done + max_new_tokens else "eos"
        self.waiting.append(_Seq(str(sample_id), len(prompt_tokens) + done, remaining, reason))

    def _kv(self) -> int:
        return sum(s.kv for s in self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            nxt = self.waiting[0]
            if self._kv() + nxt.kv + 1 > self.kv_capacity and self.running:
                return
            self.waiting.pop(0)
            if self.prefill_rate > 0:
                self._prefill_due += nxt.kv / self.prefill_rate
            self._admissions += 1
            nxt.admitted = self._admissions
            self.running.append(nxt)

    def step(self) -> list:
        events: list = []
        self._admit()
        if not self.running:
            return events
        n, kv = len(self.running), self._kv()
        # several iterations per call: until the first finish, or max_step_s of wall time
        # (of simulated time when nothing is slept)
        budget = self.max_step_s / self.time_scale if self.time_scale > 0 else self.max_step_s
        k = min(min(max(s.remaining, 1) for s in self.running), max(1, self.cost.iterations_within(n, kv, budget)))
        # KV growth: preempt the latest admitted until k iterations fit
        while len(self.running) > 1 and self._kv() + k * len(self.running) > self.kv_capacity:
            victim = max(self.running, key=lambda s: s.admitted)
            self.running.remove(victim)
            self.waiting.insert(0, victim)
            self.preemptions += 1
            events.append(PreemptedEvent(victim.sid, victim.generated, len(self.waiting)))
        n, kv = len(self.running), self._kv()
        step_sim = self.cost.iterations_time(n, kv, k) + self._prefill_due
        self._prefill_due = 0.0
        self.sim_time += step_sim
        if self.time_scale > 0:
            time.sleep(step_sim * self.time_scale)
        now = time.monotonic()
        self._rate.add(now, k * n)
        finished = []
        for s in self.running:
            m = min(k, s.remaining) if s.remaining else 1
            s.generated += m
            s.remaining = max(0, s.remaining - m)
            events.append(TokensEvent(s.sid, [TOKEN] * m, [LOGPROB] * m))
            if s.remaining == 0:
                finished.append(s)
        for s in finished:
            self.running.remove(s)
            events.append(FinishedEvent(s.sid, [TOKEN] * s.generated, [LOGPROB] * s.generated, s.reason))
        return events

    def interrupt(self, sample_ids: Sequence[str]) -> list[Partial]:
        wanted, out = {str(s) for s in sample_ids}, []
        for pool in (self.running, self.waiting):
            for s in [s for s in pool if s.sid in wanted]:
                pool.remove(s)
                out.append(Partial(s.sid, [TOKEN] * s.generated, [LOGPROB] * s.generated))
        return out

    def abort(self, sample_ids: Sequence[str]) -> None:
        self.interrupt(sample_ids)

    def load_weights(self, state_dict: Mapping[str, Any] | None, version: int) -> None:
        if self.pull_s and self.time_scale > 0:
            time.sleep(self.pull_s * self.time_scale)
        self.sim_time += self.pull_s
        self._version = version

    def stats(self) -> EngineStats:
        return EngineStats(
            version=self._version,
            running=len(self.running),
            waiting=len(self.waiting),
            kv_tokens=self._kv(),
            kv_capacity=self.kv_capacity,
            running_tokens={s.sid: s.kv for s in self.running},
            tokens_per_s=self._rate.per_s(time.monotonic()) / max(self.time_scale, 1e-9) if self.time_scale else 0.0,
            preemptions=self.preemptions,
        )
