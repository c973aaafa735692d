"""Seeded synthetic RL workload: prompt lengths and long-tailed response lengths.

Response length of member j of prompt group k:

    L = min(max_response, round(median · exp(d_k + e_kj)))
    d_k  ~ Normal(0, σ·sqrt(ρ))       prompt difficulty, shared by the group
    e_kj ~ Normal(0, σ·sqrt(1 - ρ))   per-response noise

a lognormal with total log-spread σ, chosen so that the fraction `truncated_fraction` of
responses exceeds the maximum (they are truncated at it, as with an overlong penalty), and
within-group correlation ρ of the log-lengths (`group_correlation`). Prompt lengths are
lognormal too. Group k's numbers depend only on (seed, k): every policy simulated with the
same seed sees the same workload, whatever order it consumes groups in.

Multi-turn (agentic) trajectories, `max_turns > 1`: a trajectory has
`T = min(max_turns, 1 + Poisson(mean_turns - 1))` generated turns. Turn t's length is the
formula above with its own noise e_kjt (the group's difficulty d_k shared by all turns of all
members; `max_response` caps one turn). Between turns the environment answers after a
lognormal latency (median `env_median` seconds, log-spread `env_sigma`, cut at
`env_timeout`: a long tail of slow tools) with a lognormal observation of `obs_median`
tokens that is appended to the context. The single-turn draws come first and are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class WorkloadShape:
    max_response: int = 20_000
    median_fraction: float = 0.2  # median response length / max_response
    truncated_fraction: float = 0.05  # share of responses cut at max_response
    group_correlation: float = 0.5  # share of log-length variance shared within a group
    prompt_median: int = 256
    prompt_sigma: float = 0.5
    prompt_min: int = 16
    prompt_max: int = 2048
    min_response: int = 1
    # multi-turn (module docstring); max_turns = 1: single-turn, the fields below unused
    max_turns: int = 1
    mean_turns: float = 1.0
    obs_median: int = 0  # observation tokens the environment appends after a turn
    obs_sigma: float = 0.8
    obs_max: int = 4096
    env_median: float = 0.0  # seconds from a turn's end to the environment's answer
    env_sigma: float = 1.3
    env_timeout: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.median_fraction < 1:
            raise ValueError("median_fraction must be in (0, 1)")
        if not 0 < self.truncated_fraction < 0.5:
            raise ValueError("truncated_fraction must be in (0, 0.5)")
        if not 0 <= self.group_correlation <= 1:
            raise ValueError("group_correlation must be in [0, 1]")
        if self.max_turns < 1 or not 1 <= self.mean_turns <= self.max_turns:
            raise ValueError("need max_turns >= 1 and 1 <= mean_turns <= max_turns")

    @property
    def median(self) -> float:
        return self.median_fraction * self.max_response

    @property
    def sigma(self) -> float:
        """Total log-spread so that P(L > max) = truncated_fraction."""
        z = NormalDist().inv_cdf(1.0 - self.truncated_fraction)
        return math.log(self.max_response / self.median) / z

    @property
    def multi_turn(self) -> bool:
        return self.max_turns > 1

    @property
    def max_context(self) -> int:
        """The longest context a trajectory can reach (prompt, every turn, every observation)."""
        return self.prompt_max + self.max_turns * self.max_response + (self.max_turns - 1) * self.obs_max

    def scaled(self, max_response: int) -> WorkloadShape:
        return replace(self, max_response=max_response)


@dataclass(frozen=True)
class GroupDraw:
    prompt_len: int
    lengths: np.ndarray  # response lengths (tokens, all turns), one per sample
    # multi-turn only (None otherwise), [n, max_turns], zero past a trajectory's last turn:
    turns: np.ndarray | None = None  # tokens generated in turn t
    obs: np.ndarray | None = None  # observation tokens appended after turn t
    env: np.ndarray | None = None  # seconds the environment takes to answer turn t

    def plan(self, j: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]] | None:
        """Member j's turns: (tokens per turn, observation tokens and environment seconds after
        each turn but the last); None for a single-turn workload."""
        if self.turns is None or self.obs is None or self.env is None:
            return None
        k = int((self.turns[j] > 0).sum())
        return (
            tuple(int(x) for x in self.turns[j, :k]),
            tuple(int(x) for x in self.obs[j, : k - 1]),
            tuple(float(x) for x in self.env[j, : k - 1]),
        )


class Workload:
    def __init__(self, shape: WorkloadShape, seed: int = 0):
        self.shape = shape
        self.seed = int(seed)
        s = shape.sigma
        self._sd_group = s * math.sqrt(shape.group_correlation)
        self._sd_member = s * math.sqrt(1.0 - shape.group_correlation)
        self._log_median = math.log(shape.median)

    def group(self, k: int, n: int) -> GroupDraw:
        """Group k with n members (depends only on seed, k and n)."""
        rng = np.random.default_rng([self.seed, int(k)])
        sh = self.shape
        p = math.exp(math.log(sh.prompt_median) + sh.prompt_sigma * rng.standard_normal())
        prompt = int(min(sh.prompt_max, max(sh.prompt_min, round(p))))
        d = self._sd_group * rng.standard_normal()
        e = self._sd_member * rng.standard_normal(n)
        lengths = np.rint(np.exp(self._log_median + d + e))
        lengths = np.clip(lengths, sh.min_response, sh.max_response).astype(np.int64)
        if not sh.multi_turn:
            return GroupDraw(prompt, lengths)
        # turn 1 is the single-turn draw; later turns, observations and latencies come after it
        T = sh.max_turns
        count = np.minimum(T, 1 + rng.poisson(sh.mean_turns - 1.0, n))
        later = np.rint(np.exp(self._log_median + d + self._sd_member * rng.standard_normal((n, T - 1))))
        turns = np.concatenate([lengths[:, None], np.clip(later, sh.min_response, sh.max_response)], axis=1)
        alive = np.arange(T)[None, :] < count[:, None]
        turns = np.where(alive, turns, 0).astype(np.int64)
        obs = np.rint(np.exp(math.log(max(sh.obs_median, 1)) + sh.obs_sigma * rng.standard_normal((n, T))))
        env = np.exp(math.log(max(sh.env_median, 1e-9)) + sh.env_sigma * rng.standard_normal((n, T)))
        between = np.arange(T)[None, :] < (count - 1)[:, None]  # an answer follows every turn but the last
        obs = np.where(between, np.clip(obs, 1, sh.obs_max), 0).astype(np.int64)
        env = np.where(between, np.minimum(env, sh.env_timeout), 0.0)
        return GroupDraw(prompt, turns.sum(axis=1), turns, obs, env)

    def sample(self, groups: int, n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(prompt lengths [groups], response lengths [groups, n]) for groups start.. ."""
        draws = [self.group(start + k, n) for k in range(groups)]
        return np.array([d.prompt_len for d in draws]), np.stack([d.lengths for d in draws])

    def stats(self, groups: int = 2000, n: int = 8) -> dict[str, float]:
        if self.shape.multi_turn:
            return self._turn_stats(groups, n)
        prompts, lengths = self.sample(groups, n, start=1 << 30)
        L = lengths.astype(float)
        return {
            "prompt_mean": float(prompts.mean()),
            "response_mean": float(L.mean()),
            "response_median": float(np.median(L)),
            "response_p99": float(np.percentile(L, 99)),
            "truncated_fraction": float((lengths >= self.shape.max_response).mean()),
            # a running sample's context averaged over its decode time (token-weighted)
            "mean_running_context": float(prompts.mean() + (L**2).mean() / (2 * L.mean())),
        }

    def _turn_stats(self, groups: int, n: int) -> dict[str, float]:
        draws = [self.group((1 << 30) + k, n) for k in range(groups)]
        turns = np.concatenate([d.turns for d in draws]).astype(float)
        obs = np.concatenate([d.obs for d in draws]).astype(float)
        env = np.concatenate([d.env for d in draws])
        prompts = np.repeat([float(d.prompt_len) for d in draws], n)
        L = turns.sum(axis=1)
        count = (turns > 0).sum(axis=1)
        per_turn = turns[turns > 0]
        waits = env[obs > 0]
        # context when turn t starts: prompt + earlier turns and observations; a running turn of
        # l tokens holds base + l/2 on average, so the token-weighted mean is sum(base·l + l²/2) / sum(l)
        base = prompts[:, None] + np.cumsum(turns + obs, axis=1) - (turns + obs)
        return {
            "prompt_mean": float(prompts.mean()),
            "response_mean": float(L.mean()),
            "response_median": float(np.median(L)),
            "response_p99": float(np.percentile(L, 99)),
            "truncated_fraction": float((per_turn >= self.shape.max_response).mean()),
            "mean_running_context": float(((base * turns).sum() + (turns**2).sum() / 2) / turns.sum()),
            "turns_mean": float(count.mean()),
            "turn_tokens_mean": float(per_turn.mean()),
            "turn_tokens_median": float(np.median(per_turn)),
            "obs_tokens_mean": float(obs[obs > 0].mean()) if waits.size else 0.0,
            "env_mean": float(waits.mean()) if waits.size else 0.0,
            "env_median": float(np.median(waits)) if waits.size else 0.0,
            "env_p99": float(np.percentile(waits, 99)) if waits.size else 0.0,
            "env_per_trajectory": float(env.sum(axis=1).mean()),
        }
