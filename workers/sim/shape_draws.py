"""Random workload shapes: set-ups nobody tuned the coordinator on (bench/random_shapes.py).

Shape `k` is a seeded draw (the same set-up for the same `k`, on any machine) that changes every
knob of a reference set-up at once: the model (one of the four fitted cost models, with its
tensor parallelism), the instance count, the batch (B prompts × N responses), the response
length distribution (maximum, median as a fraction of it, share truncated at the maximum,
within-group correlation), the prompt length, and the trainer's size (the rest of the 128-GPU
cluster, or a small trainer that makes the run trainer-bound). The draw's ranges span what
RL post-training runs use, from 2K-token answers to 32K-token reasoning traces, from 4 to 48
instances; no combination is excluded, so some shapes are odd on purpose (long prompts with
very short answers, a 32K tail on 8 instances).
"""

from __future__ import annotations

import random

from .setups import PAPER_SETUPS, SETUPS, Setup
from .workload import WorkloadShape

MAX_RESPONSES = (2_000, 4_000, 8_000, 16_000, 20_000, 32_000)
MEDIAN_FRACTIONS = (0.03, 0.08, 0.15, 0.25, 0.4)
TRUNCATED_FRACTIONS = (0.01, 0.05, 0.15, 0.3)
GROUP_CORRELATIONS = (0.0, 0.3, 0.5, 0.8, 0.95)
PROMPT_MEDIANS = (128, 256, 1024, 3000)
BATCH_SIZES = (16, 32, 64, 128, 256)
GROUP_SIZES = (4, 8, 16)
SMALL_TRAINERS = (8, 16, 32, 64)


def random_setup(k: int) -> Setup:
    """Shape `k` (k >= 0), named `random_<k>_<model>`."""
    r = random.Random(1000 + k)
    base = SETUPS[r.choice(PAPER_SETUPS)]
    max_response = r.choice(MAX_RESPONSES)
    workload = WorkloadShape(
        max_response=max_response,
        median_fraction=r.choice(MEDIAN_FRACTIONS),
        truncated_fraction=r.choice(TRUNCATED_FRACTIONS),
        group_correlation=r.choice(GROUP_CORRELATIONS),
        prompt_median=r.choice(PROMPT_MEDIANS),
    )
    instances = r.choice((8, 16, 32, 48)) if base.tp == 1 else r.choice((4, 8, 16, 24))
    # the rest of the cluster (as the reference set-ups), or a small trainer (trainer-bound runs)
    train_gpus = max(8, 128 - instances * base.tp) if r.random() < 0.6 else r.choice(SMALL_TRAINERS)
    return base.scaled(
        name=f"random_{k}_{base.name}",
        batch_size=r.choice(BATCH_SIZES),
        group_size=r.choice(GROUP_SIZES),
        max_response=max_response,
        workload=workload,
        instances=instances,
        train_gpus=train_gpus,
    )


def describe(s: Setup) -> str:
    """One line for a table: what the draw chose."""
    w = s.workload
    return (
        f"{s.model} ×{s.instances}, B×N {s.batch_size}×{s.group_size}, answers ≤{w.max_response // 1000}K "
        f"(median {w.median_fraction:.0%}, {w.truncated_fraction:.0%} cut, ρ {w.group_correlation}), "
        f"prompts ~{min(w.prompt_median, w.prompt_max)}, trainer {s.trainer_gpus} GPUs"
    )
