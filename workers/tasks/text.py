"""Tasks as text, tokenized by a real model's tokenizer (for `--model PATH` runs).

The tiny model's tasks emit token ids of its own 16-token vocabulary; a Hugging Face model
needs the same task phrased in words and encoded by its tokenizer (through its chat
template when it has one). The reward stays rule-based on token ids: the `repeat` verifier
gets the tokenizer's id of the symbol and of EOS in each prompt's metadata.
"""

from __future__ import annotations

import random
from typing import Any

from workers.models.hf import encode_prompt
from workers.tasks.repeat import SYMBOL0, RepeatTask

SYMBOLS = ("a", "b", "c", "d", "x", "y", "z", "o")


def symbol_ids(tokenizer: Any, n: int) -> list[tuple[str, int]]:
    """`n` symbols that each encode to one token (without special tokens)."""
    found = []
    for text in SYMBOLS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            found.append((text, int(ids[0])))
        if len(found) == n:
            return found
    raise ValueError(f"the tokenizer encodes fewer than {n} of {SYMBOLS} as a single token")


def repeat_prompts(
    tokenizer: Any, n: int, seed: int, prefix: str = "repeat", task: RepeatTask = RepeatTask()
) -> list[tuple[str, list[int], dict]]:
    """The `repeat` task's prompts (same draws as `task.prompts(n, seed, prefix)`), worded
    ("Write a exactly 7 times.") and tokenized; metadata for the `repeat` verifier."""
    symbols = symbol_ids(tokenizer, task.n_symbols)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        _, meta = task.prompt(rng)
        text, sym = symbols[meta["symbol"] - SYMBOL0]
        tokens = encode_prompt(tokenizer, f"Write {text} exactly {meta['count']} times.")
        out.append((f"{prefix}-{seed}-{i}", tokens, {**meta, "symbol": sym, "eos": int(eos)}))
    return out
