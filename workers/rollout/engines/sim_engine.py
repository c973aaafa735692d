"""The `sim` engine: continuous batching on the cost-model clock, in real (scaled) time.

No model and no torch: each decode iteration of `n` running samples holding `kv` KV tokens
takes `latency(n, kv)` simulated seconds (the cost model, docs/coordinator.md), slept as `latency · time_scale`
wall seconds, so a real-service run of the whole system (API, coordinator, workers, trainer)
behaves like GPUs of that kind, faster. Batching — admission with a KV watermark, decode
timing, preemption of the most recently admitted sample — is `timing.BatchModel`, the model
the simulator's instances run too; this class adds the engine API, prefill charged at
admission, and real (scaled) time. A sample that alone outgrows the KV cache finishes with
reason "capacity".

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
from workers.rollout.engines.timing import BatchModel
from workers.settings import sim_engine_settings
from workers.wire.models.rollout import Capacity

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
class _Lengths:
    """Token counts of the samples on this engine, for the batch model (see timing.Lengths)."""

    prompt: dict[str, int] = field(default_factory=dict)
    gen: dict[str, int] = field(default_factory=dict)  # response tokens, prefix included
    target: dict[str, int] = field(default_factory=dict)
    prefix: dict[str, int] = field(default_factory=dict)  # response tokens before this stretch
    reason: dict[str, str] = field(default_factory=dict)  # finish reason at `target`

    def stretch(self, sid: str) -> int:
        return self.gen[sid] - self.prefix[sid]

    def drop(self, sid: str) -> None:
        for d in (self.prompt, self.gen, self.target, self.prefix, self.reason):
            d.pop(sid, None)


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
        # wall seconds per simulated second; 0.1 runs ten times faster than the GPUs modelled
        self.time_scale = env.time_scale if time_scale is None else time_scale
        self.max_step_s = max_step_s
        # simulated seconds to load new weights, and prefill tokens/s charged at each admission
        self.pull_s = env.pull_s if pull_s is None else pull_s
        self.prefill_rate = env.prefill_rate if prefill_rate is None else prefill_rate
        self._prefill_due = 0.0
        self._version = version
        self._len = _Lengths()
        self.batch = BatchModel(self.cost, kv_capacity_tokens, max_running, self._len)
        self.sim_time = 0.0
        self._rate = _Rate()

    @property
    def version(self) -> int:
        return self._version

    @property
    def preemptions(self) -> int:
        return self.batch.preemptions

    def add_request(self, sample_id, prompt_tokens, prefix_tokens=(), prefix_logprobs=(), max_new_tokens=256, seed=0):
        sid, done = str(sample_id), len(prefix_tokens)
        self.batch.remove([sid])  # a sample is held once: a new route replaces a stale copy
        total = target_length(prompt_tokens, seed, done + max_new_tokens)
        lens = self._len
        lens.prompt[sid], lens.gen[sid], lens.prefix[sid] = len(prompt_tokens), done, done
        lens.target[sid] = done + max(1, total - done)  # a stretch yields at least one token
        lens.reason[sid] = "length" if total >= done + max_new_tokens else "eos"
        self.batch.waiting.append(sid)

    def _stretch_out(self, sid: str) -> tuple[list[int], list[float]]:
        m = self._len.stretch(sid)
        self._len.drop(sid)
        return [TOKEN] * m, [LOGPROB] * m

    def step(self) -> list:
        events: list = []
        b = self.batch
        prefill = b.admit()
        if prefill and self.prefill_rate > 0:
            self._prefill_due += prefill / self.prefill_rate
        while b.n > 1 and b.room() <= 0:
            # the worker applies φ_wait to the event (the sample waits here meanwhile)
            sid, _ = b.preempt()
            events.append(PreemptedEvent(sid, self._len.stretch(sid), len(b.waiting)))
        if b.n == 1 and b.room() <= 0:
            (sid,) = b.remove(list(b.run))
            events.append(FinishedEvent(sid, *self._stretch_out(sid), "capacity"))
            return events
        if not b.n:
            return events
        # several iterations per call: until the first finish or the KV cache is full, or
        # max_step_s of wall time (of simulated time when nothing is slept)
        budget = self.max_step_s / self.time_scale if self.time_scale > 0 else self.max_step_s
        k = min(b.to_finish(), b.room(), max(1, b.within(budget)))
        n = b.n
        step_sim = b.time(k) + self._prefill_due
        self._prefill_due = 0.0
        self.sim_time += step_sim
        if self.time_scale > 0:
            time.sleep(step_sim * self.time_scale)
        self._rate.add(time.monotonic(), k * n)
        events.extend(TokensEvent(sid, [TOKEN] * k, [LOGPROB] * k) for sid in b.run)
        for sid in b.decode(k):
            reason = self._len.reason[sid]
            events.append(FinishedEvent(sid, *self._stretch_out(sid), reason))
        return events

    def interrupt(self, sample_ids: Sequence[str]) -> list[Partial]:
        return [Partial(sid, *self._stretch_out(sid)) for sid in self.batch.remove(str(s) for s in sample_ids)]

    def abort(self, sample_ids: Sequence[str]) -> None:
        self.interrupt(sample_ids)

    def load_weights(self, state_dict: Mapping[str, Any] | None, version: int) -> None:
        if self.pull_s and self.time_scale > 0:
            time.sleep(self.pull_s * self.time_scale)
        self.sim_time += self.pull_s
        self._version = version

    def capacity(self) -> Capacity:
        # the batch model's, as the simulator's instances report it (workers/sim/engine.py)
        return Capacity(max_running=self.batch.max_running, kv_capacity=self.batch.cap)

    def stats(self) -> EngineStats:
        b = self.batch
        return EngineStats(
            version=self._version,
            running=b.n,
            waiting=len(b.waiting),
            kv_tokens=b.kv,
            running_tokens={sid: b.context(sid) for sid in b.run},
            tokens_per_s=self._rate.per_s(time.monotonic()) / max(self.time_scale, 1e-9) if self.time_scale else 0.0,
            preemptions=b.preemptions,
        )
