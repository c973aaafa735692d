"""The demo's toy verifiable task: "write SYMBOL exactly COUNT times, then stop".

Answer lengths are long-tailed (COUNT is log-normal, a few prompts ask for many tokens), so a
batch shows the length skew StaleFlow is built to absorb, yet a tiny transformer trained from
scratch on CPU learns it within minutes. Token ids: 0 EOS, 1 BOS, 2..11 digits, 12.. symbols.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

EOS, BOS, DIGIT0, SYMBOL0 = 0, 1, 2, 12


@dataclass(frozen=True)
class RepeatTask:
    n_symbols: int = 4
    median_count: float = 4.0
    sigma: float = 0.8  # log-normal spread: the long tail
    max_count: int = 40
    max_response: int = 48

    @property
    def vocab_size(self) -> int:
        return SYMBOL0 + self.n_symbols

    def prompt(self, rng: random.Random) -> tuple[list[int], dict]:
        symbol = SYMBOL0 + rng.randrange(self.n_symbols)
        count = max(1, min(self.max_count, round(math.exp(rng.gauss(math.log(self.median_count), self.sigma)))))
        tokens = [BOS, symbol, DIGIT0 + count // 10, DIGIT0 + count % 10]
        return tokens, {"symbol": symbol, "count": count, "eos": EOS, "max": self.max_response}

    def prompts(self, n: int, seed: int, prefix: str = "repeat") -> list[tuple[str, list[int], dict]]:
        """`n` prompts with client keys `prefix-seed-i`: enqueueing them twice is harmless."""
        rng = random.Random(seed)
        return [(f"{prefix}-{seed}-{i}", *self.prompt(rng)) for i in range(n)]
