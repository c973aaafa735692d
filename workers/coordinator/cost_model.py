"""Decode-iteration cost model of a rollout instance (docs/coordinator.md).

    latency(n, kv) = attn_b + attn_k·kv + max(other_threshold, other_b + other_k·n)
    T(n, kv)       = n / latency(n, kv)        tokens per second

`n` is the number of running samples, `kv` the KV-cache tokens they hold — decoding ones only:
a multi-turn trajectory waiting for its environment between turns holds no decode slot, and
its wait is not decode time (`Remaining` keeps the two apart). Coefficients are
fitted offline per (model, GPU, parallelism); `cost_models.json` ships inside this package
(a copy of the project's ``shared/cost_models.json``, which is used when the packaged copy is
missing). `fit` recovers coefficients from engine logs.

Pure Python + numpy; no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PACKAGED_PATH = Path(__file__).resolve().parent / "cost_models.json"
SHARED_PATH = Path(__file__).resolve().parents[3] / "shared" / "cost_models.json"

_FIELDS = ("other_threshold", "other_b", "other_k", "attn_b", "attn_k")


@dataclass(frozen=True)
class Remaining:
    """A trajectory's expected time to an end, split by what it holds while it waits: decode
    time holds a decode slot and KV on its instance (it loads the batch); environment time
    holds no GPU (tool calls, sandboxes between turns) and loads nothing."""

    decode_s: float
    env_s: float = 0.0

    @property
    def total(self) -> float:
        return self.decode_s + self.env_s


@dataclass(frozen=True)
class CostModel:
    other_threshold: float
    other_b: float
    other_k: float
    attn_b: float
    attn_k: float

    # ---- evaluation ------------------------------------------------------------------------

    def _latency(self, n: Any, kv: Any, maximum: Callable[[Any, Any], Any]) -> Any:
        # the one latency formula: attention grows with the KV held, the rest with the batch
        # once past a floor; `maximum` is max for scalars and np.maximum for arrays
        return self.attn_b + self.attn_k * kv + maximum(self.other_threshold, self.other_b + self.other_k * n)

    def latency(self, n: float, kv: float) -> float:
        """Seconds per decode iteration with `n` running samples holding `kv` KV tokens."""
        return float(self._latency(n, kv, max))

    def throughput(self, n: float, kv: float) -> float:
        """Tokens per second, T(n, kv) = n / latency(n, kv); 0 for an empty instance."""
        if n <= 0:
            return 0.0
        return n / self.latency(n, kv)

    T = throughput

    def marginal_gain(self, n: float, kv: float, length: float) -> float:
        """ΔT of adding one sample of `length` context tokens: T(n+1, kv+l) - T(n, kv)."""
        return self.throughput(n + 1, kv + length) - self.throughput(n, kv)

    def latency_array(self, n: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """`latency` over numpy arrays (broadcast), for routing's [sample x instance] gains."""
        return np.asarray(self._latency(n, kv, np.maximum))

    def throughput_array(self, n: np.ndarray, kv: np.ndarray) -> np.ndarray:
        n = np.asarray(n, dtype=float)
        return np.where(n > 0, n / self.latency_array(n, np.asarray(kv, dtype=float)), 0.0)

    def remaining(self, n: float, kv: float, decode_tokens: float, env_s: float = 0.0) -> Remaining:
        """`decode_tokens` more tokens at the current iteration time of an instance at (n, kv),
        plus `env_s` seconds of environment latency, kept apart (not decode time)."""
        return Remaining(max(0.0, decode_tokens) * self.latency(n, kv), max(0.0, env_s))

    def iterations_time(self, n: int, kv: float, k: int) -> float:
        """Seconds for `k` decode iterations starting at (n, kv); each one adds n KV tokens."""
        return k * self.latency(n, kv) + self.attn_k * n * k * (k - 1) / 2.0

    def iterations_within(self, n: int, kv: float, budget: float) -> int:
        """The most whole decode iterations that finish within `budget` seconds from (n, kv)."""
        if budget <= 0 or n <= 0:
            return 0
        c0 = self.latency(n, kv)
        a = self.attn_k * n / 2.0
        if a <= 0:
            k = int(budget / c0)
        else:
            b = c0 - a
            k = int((-b + math.sqrt(b * b + 4.0 * a * budget)) / (2.0 * a))
        # guard the float rounding of the closed form
        if k > 0 and self.iterations_time(n, kv, k) > budget:
            k -= 1
            while k > 0 and self.iterations_time(n, kv, k) > budget:
                k -= 1
        elif self.iterations_time(n, kv, k + 1) <= budget:
            k += 1
            while self.iterations_time(n, kv, k + 1) <= budget:
                k += 1
        return k

    def peak_throughput(self, context_per_sample: float, kv_capacity: float, max_running: int) -> float:
        """T at the most samples of `context_per_sample` tokens that fit (T grows with n)."""
        n = max(1, min(max_running, int(kv_capacity // max(context_per_sample, 1.0))))
        return self.throughput(n, n * context_per_sample)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostModel:
        return cls(**{k: float(d[k]) for k in _FIELDS})


# ---- loading ---------------------------------------------------------------------------------


def default_path() -> Path:
    """The packaged copy when present (an installed package has no shared/), else shared/."""
    return PACKAGED_PATH if PACKAGED_PATH.exists() else SHARED_PATH


def load_cost_models(path: str | Path | None = None) -> dict[str, dict[str, CostModel]]:
    """All fits: {model: {parallelism: CostModel}} (keys starting with '_' are comments)."""
    raw = json.loads(Path(path or default_path()).read_text())
    return {
        model: {par: CostModel.from_dict(c) for par, c in pars.items()}
        for model, pars in raw.items()
        if not model.startswith("_")
    }


def get_cost_model(model: str, parallelism: str | None = None, path: str | Path | None = None) -> CostModel:
    """One fit; `parallelism` may be omitted when the model has a single one."""
    models = load_cost_models(path)
    if model not in models:
        raise KeyError(f"no cost model for {model!r}; known: {sorted(models)}")
    pars = models[model]
    if parallelism is None:
        if len(pars) != 1:
            raise KeyError(f"{model!r} has several fits {sorted(pars)}; name one")
        return next(iter(pars.values()))
    if parallelism not in pars:
        raise KeyError(f"{model!r} has no fit for {parallelism!r}; known: {sorted(pars)}")
    return pars[parallelism]


def latency(n: float, kv: float, model: CostModel) -> float:
    return model.latency(n, kv)


def throughput(n: float, kv: float, model: CostModel) -> float:
    return model.throughput(n, kv)


# ---- fitting ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitResult:
    model: CostModel
    rmse: float  # seconds
    breakpoint_n: float  # n where other_b + other_k·n crosses other_threshold


def _rows(samples: Iterable[Any]) -> np.ndarray:
    out = []
    for r in samples:
        if isinstance(r, Mapping):
            out.append((float(r["n"]), float(r["kv"]), float(r["latency"])))
        else:
            n, kv, lat = r[:3]
            out.append((float(n), float(kv), float(lat)))
    arr = np.asarray(out, dtype=float).reshape(-1, 3)
    if len(arr) < 4:
        raise ValueError(f"need at least 4 rows (n, kv, latency) to fit, got {len(arr)}")
    return arr


def _hinge_fit(n: np.ndarray, kv: np.ndarray, y: np.ndarray, knot: float) -> tuple[np.ndarray, float]:
    X = np.column_stack([np.ones_like(n), kv, np.maximum(0.0, n - knot)])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    return coef, float(resid @ resid)


def fit(samples: Iterable[Any] | np.ndarray, attn_b: float = 0.0, grid: int = 200) -> FitResult:
    """Fit the coefficients from engine logs: rows of (n, kv, measured latency in seconds).

    `latency = c + attn_k·kv + other_k·max(0, n - n*)` is the same curve as the max() form
    (n* is where `other_b + other_k·n` crosses `other_threshold`); for each candidate n* it
    is linear, so least squares over a grid of n* (then a golden-section refinement) finds
    the best piecewise fit. The constants `attn_b`, `other_threshold` and `other_b` are
    identifiable only as the sums `attn_b + other_threshold` and `attn_b + other_b`; pass
    `attn_b` when it is known separately (e.g. from attention-kernel timings).
    """
    arr = _rows(samples) if not isinstance(samples, np.ndarray) else np.asarray(samples, float).reshape(-1, 3)
    n, kv, y = arr[:, 0], arr[:, 1], arr[:, 2]
    lo, hi = float(n.min()), float(n.max())
    knots = np.linspace(lo, hi, max(grid, 2))
    sse = [(_hinge_fit(n, kv, y, k)[1], k) for k in knots]
    best_sse, best_knot = min(sse)
    # golden-section refinement around the best grid point (SSE is piecewise smooth in n*)
    step = (hi - lo) / max(grid - 1, 1)
    a, b = max(lo, best_knot - step), min(hi, best_knot + step)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        c, d = b - g * (b - a), a + g * (b - a)
        if _hinge_fit(n, kv, y, c)[1] < _hinge_fit(n, kv, y, d)[1]:
            b = d
        else:
            a = c
    knot = (a + b) / 2
    if _hinge_fit(n, kv, y, knot)[1] > best_sse:
        knot = best_knot
    (c0, ak, ok), err = _hinge_fit(n, kv, y, knot)
    ok = max(ok, 0.0)
    threshold = c0 - attn_b
    other_b = threshold - ok * knot
    model = CostModel(other_threshold=threshold, other_b=other_b, other_k=ok, attn_b=attn_b, attn_k=ak)
    return FitResult(model, math.sqrt(err / len(y)), knot)
