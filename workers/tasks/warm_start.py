"""A warm start for the `repeat` task: the stand-in for pretraining.

Real RL post-training starts from a pretrained model that already answers in the expected
format and roughly right; RL then makes it exact. Here the "pretraining" is a brief
supervised phase on *imperfect* demonstrations: the prompt's symbol repeated COUNT + d
times, then EOS, with d uniform in -noise..+noise (noise 3: only 1 demonstration in 7 is
exact, and the long tail is as rough as the rest). The model learns the format and an
approximate length; exact answers, about the 1-in-7 of the demonstrations at first, are
what RL has to learn. `noise=None` draws the length independently of COUNT (format only).
"""

from __future__ import annotations

import random

import torch
from torch import nn

from workers.tasks.repeat import EOS, RepeatTask


def demos(task: RepeatTask, n: int, rng: random.Random, noise: int | None = 3) -> list[list[int]]:
    """`n` prompt + response sequences, each response COUNT +- noise symbols long (at least 1)."""
    rows = []
    for _ in range(n):
        prompt, meta = task.prompt(rng)
        if noise is None:
            length = task.prompt(rng)[1]["count"]  # an independent draw: right format, any count
        else:
            length = meta["count"] + rng.randint(-noise, noise)
        length = max(1, min(task.max_response - 1, length))
        rows.append(prompt + [meta["symbol"]] * length + [EOS])
    return rows


def warm_start(
    model: nn.Module,
    task: RepeatTask,
    steps: int = 200,
    seed: int = 0,
    noise: int | None = 3,
    lr: float = 2e-3,
    rows: int = 64,
) -> float:
    """Cross-entropy on the response tokens of `demos` (the prompt is always 4 tokens:
    BOS, symbol, two digits); returns the last loss. The model is left without grads."""
    rng = random.Random(f"warm-start-{seed}")
    threads = torch.get_num_threads()
    # one thread: these small matrices gain nothing from more, and on a machine shared with
    # the demo's other processes extra threads spin against them (measured 100x slower)
    torch.set_num_threads(1)
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        batch = demos(task, rows, rng, noise)
        width = max(len(r) for r in batch)
        x = torch.tensor([r + [EOS] * (width - len(r)) for r in batch])
        # target j is token j + 1: the response and its EOS are tokens 4 .. len - 1
        mask = torch.tensor([[0.0] * 3 + [1.0] * (len(r) - 4) + [0.0] * (width - len(r)) for r in batch])
        logp = torch.log_softmax(model(x[:, :-1]).float(), dim=-1).gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.requires_grad_(False)
    torch.set_num_threads(threads)
    return float(loss.detach())
