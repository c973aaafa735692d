"""A warm start for the demo's tasks: the stand-in for pretraining.

Real RL post-training starts from a pretrained model that already answers in the expected
format and roughly right; RL then makes it exact. Here the "pretraining" is a brief
supervised phase on *imperfect* demonstrations: the prompt's symbol repeated COUNT + d
times, then EOS, with d uniform in -noise..+noise (noise 3: only 1 demonstration in 7 is
exact, and the long tail is as rough as the rest). The model learns the format and an
approximate length; exact answers, about the 1-in-7 of the demonstrations at first, are
what RL has to learn. `noise=None` draws the length independently of COUNT (format only).
Another task brings its own demonstrations with their loss masks (`demo`: the multi-turn
task's noisy binary searches, workers/tasks/guess.py, learned on the model's turns only).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import nn

from workers.tasks.repeat import EOS, RepeatTask

# (rng) -> a demonstration's tokens (prompt and response) and its loss mask (1 on the tokens to learn)
Demo = Callable[[random.Random], tuple[list[int], list[int]]]


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


def repeat_demo(task: RepeatTask, noise: int | None = 3) -> Demo:
    """`demos` one at a time, the loss on the response (the prompt is always 4 tokens: BOS,
    symbol, two digits)."""

    def one(rng: random.Random) -> tuple[list[int], list[int]]:
        (row,) = demos(task, 1, rng, noise)
        return row, [0] * 4 + [1] * (len(row) - 4)

    return one


def warm_start(
    model: nn.Module,
    task: RepeatTask,
    steps: int = 200,
    seed: int = 0,
    noise: int | None = 3,
    lr: float = 2e-3,
    rows: int = 64,
    demo: Demo | None = None,
) -> float:
    """Cross-entropy on the masked tokens of the demonstrations (`demo`, by default the repeat
    task's `demos`); returns the last loss. The model is left without grads."""
    demo = demo or repeat_demo(task, noise)
    rng = random.Random(f"warm-start-{seed}")
    threads = torch.get_num_threads()
    # one thread: these small matrices gain nothing from more, and on a machine shared with
    # the demo's other processes extra threads spin against them (measured 100x slower)
    torch.set_num_threads(1)
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        batch = [demo(rng) for _ in range(rows)]
        width = max(len(r) for r, _ in batch)
        x = torch.tensor([r + [EOS] * (width - len(r)) for r, _ in batch])
        # target j is token j + 1: learned where token j + 1 is masked in
        mask = torch.tensor([[float(v) for v in m[1:]] + [0.0] * (width - len(m)) for _, m in batch])
        logp = torch.log_softmax(model(x[:, :-1]).float(), dim=-1).gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.requires_grad_(False)
    torch.set_num_threads(threads)
    return float(loss.detach())
