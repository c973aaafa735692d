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

    def __post_init__(self) -> None:
        if not 0 < self.median_fraction < 1:
            raise ValueError("median_fraction must be in (0, 1)")
        if not 0 < self.truncated_fraction < 0.5:
            raise ValueError("truncated_fraction must be in (0, 0.5)")
        if not 0 <= self.group_correlation <= 1:
            raise ValueError("group_correlation must be in [0, 1]")

    @property
    def median(self) -> float:
        return self.median_fraction * self.max_response

    @property
    def sigma(self) -> float:
        """Total log-spread so that P(L > max) = truncated_fraction."""
        z = NormalDist().inv_cdf(1.0 - self.truncated_fraction)
        return math.log(self.max_response / self.median) / z

    def scaled(self, max_response: int) -> WorkloadShape:
        return replace(self, max_response=max_response)


@dataclass(frozen=True)
class GroupDraw:
    prompt_len: int
    lengths: np.ndarray  # response lengths (tokens), one per sample


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
        return GroupDraw(prompt, lengths)

    def sample(self, groups: int, n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(prompt lengths [groups], response lengths [groups, n]) for groups start.. ."""
        draws = [self.group(start + k, n) for k in range(groups)]
        return np.array([d.prompt_len for d in draws]), np.stack([d.lengths for d in draws])

    def stats(self, groups: int = 2000, n: int = 8) -> dict[str, float]:
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
