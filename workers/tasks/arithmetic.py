"""A small arithmetic data set the project generates itself (no download), for tests and
examples of the `math` verifier: "Compute 17 + 4 * 3. Put the answer in \\boxed{}.".

Levels grow in operand size and number of operations, so answer lengths vary:
  1: a + b or a - b, operands 0..9
  2: two operations of + - *, operands 0..99 (precedence matters)
  3: three operations of + - * and one exact division, operands 0..999, parentheses
Answers are integers, computed exactly (Python's own arithmetic on the same expression).
`staleflow dataset arithmetic` writes them as JSONL lines `{"id", "prompt", "answer", "level"}`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

LEVELS = (1, 2, 3)
INSTRUCTION = "Put the final answer in \\boxed{}."


def _expression(rng: random.Random, level: int) -> str:
    if level == 1:
        return f"{rng.randint(0, 9)} {rng.choice('+-')} {rng.randint(0, 9)}"
    if level == 2:
        a, b, c = (rng.randint(0, 99) for _ in range(3))
        return f"{a} {rng.choice('+-*')} {b} {rng.choice('+-*')} {c}"
    a, b, c = (rng.randint(0, 999) for _ in range(3))
    inner = f"({a} {rng.choice('+-*')} {b})"
    # an exact division: the divisor divides the product it follows
    d = rng.randint(1, 12)
    return f"{inner} {rng.choice('+-')} {c} * {d * rng.randint(1, 9)} / {d}"


def evaluate(expression: str) -> int:
    """The exact integer value of an expression of this module (digits, + - * /, parentheses)."""
    if set(expression) - set("0123456789+-*/() "):
        raise ValueError(f"not an arithmetic expression: {expression!r}")
    # "/" only appears as an exact division, so true division of ints is exact here; the
    # expression holds nothing but digits and operators, so eval cannot reach any name
    value = eval(expression, {"__builtins__": {}}, {})
    if value != int(value):
        raise ValueError(f"{expression!r} is not an integer ({value})")
    return int(value)


def problems(n: int, seed: int = 0, levels: tuple[int, ...] = LEVELS) -> Iterator[dict]:
    """`n` problems, levels drawn uniformly from `levels`; the same (n, seed) gives the same
    lines, with ids `arith-SEED-I` (stable keys for idempotent enqueueing)."""
    rng = random.Random(seed)
    for i in range(n):
        level = rng.choice(levels)
        expr = _expression(rng, level)
        yield {
            "id": f"arith-{seed}-{i}",
            "prompt": f"Compute {expr}. {INSTRUCTION}",
            "answer": str(evaluate(expr)),
            "level": level,
        }


def write_jsonl(path: Path, n: int, seed: int = 0, levels: tuple[int, ...] = LEVELS) -> int:
    with Path(path).open("w") as f:
        for p in problems(n, seed, levels):
            f.write(json.dumps(p) + "\n")
    return n
