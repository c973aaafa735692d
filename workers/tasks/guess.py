"""The multi-turn demo task: find a hidden number in 0..14 in at most 5 guesses, the
environment (workers/envs/guess.py) answering each wrong guess with `<` (lower) or `>`
(higher). The prompt is the same for every target: only the feedback tells the model where
to look, so the later turns carry the task; a binary search always finds it (3.27 guesses on
average, at most 4: one guess of slack), guesses that ignore the feedback rarely do (30%).

Token ids: 0 EOS (ends a turn), 1 BOS, 2 `G` (the prompt), 3 `<`, 4 `>`, 5.. the numbers.
`GuessCodec` maps them to the environment's text (words separated by spaces)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

EOS, BOS, G, LOWER, HIGHER, NUMBER0 = 0, 1, 2, 3, 4, 5
WORDS = {G: "G", LOWER: "<", HIGHER: ">"}


class GuessCodec:
    """Token ids <-> the environment's text: `7`, `<`, `>` (EOS and BOS are not text)."""

    def encode(self, text: str) -> list[int]:
        ids = {w: t for t, w in WORDS.items()}
        return [ids[w] if w in ids else NUMBER0 + int(w) for w in text.split()]

    def decode(self, tokens: Sequence[int]) -> str:
        return " ".join(WORDS.get(t, str(t - NUMBER0)) for t in tokens if t not in (EOS, BOS))


@dataclass(frozen=True)
class GuessTask:
    numbers: int = 15
    max_turns: int = 5
    max_response: int = 16  # 5 turns of a number and EOS, 4 answers

    @property
    def vocab_size(self) -> int:
        return NUMBER0 + self.numbers

    def prompt(self, rng: random.Random) -> tuple[list[int], dict]:
        return [BOS, G], {"target": rng.randrange(self.numbers), "max_turns": self.max_turns}

    def prompts(self, n: int, seed: int, prefix: str = "guess") -> list[tuple[str, list[int], dict]]:
        """`n` prompts with client keys `prefix-seed-i`: enqueueing them twice is harmless."""
        rng = random.Random(seed)
        return [(f"{prefix}-{seed}-{i}", *self.prompt(rng)) for i in range(n)]

    def demo(self, rng: random.Random, noise: float) -> tuple[list[int], list[int]]:
        """A warm-start demonstration and its loss mask (1 on the model's tokens): a binary
        search whose every guess is, with probability `noise`, any number at all instead of
        the middle of what is still possible (the imperfect "pretrained" searcher RL starts
        from: in 5 guesses, noise 0.5 finds 64% of the targets, noise 0 all of them)."""
        target = rng.randrange(self.numbers)
        lo, hi = 0, self.numbers - 1
        tokens, mask = [BOS, G], [0, 0]
        for _ in range(self.max_turns):
            guess = rng.randrange(self.numbers) if rng.random() < noise else (lo + hi) // 2
            tokens += [NUMBER0 + guess, EOS]
            mask += [1, 1]
            if guess == target:
                break
            if target < guess:
                hi = min(hi, guess - 1)
                tokens.append(LOWER)
            else:
                lo = max(lo, guess + 1)
                tokens.append(HIGHER)
            mask.append(0)
        if tokens[-1] in (LOWER, HIGHER):  # the environment says nothing after the last turn
            tokens.pop()
            mask.pop()
        return tokens, mask
