"""Number guessing (the multi-turn demo's environment, workers/tasks/guess.py): the model
guesses the hidden number `meta["target"]`, one guess per turn (the turn's first number), and
the environment answers `<` (the number is lower), `>` (higher), or ends the trajectory on a
hit. Later turns matter: only the feedback narrows the search. Reward 1 for a hit, 0 after
`max_turns` misses (`meta["max_turns"]` when given)."""

from __future__ import annotations

import re
from typing import Any

from .base import Step

GUESS = re.compile(r"(\d+)")


class GuessEnv:
    def __init__(self, max_turns: int = 5):
        self.max_turns = max_turns
        self.target, self.turns = 0, 0

    def reset(self, prompt: str, meta: dict[str, Any]) -> str:
        self.target, self.turns = int(meta["target"]), 0
        self.max_turns = int(meta.get("max_turns", self.max_turns))
        return ""

    def step(self, turn: str) -> Step:
        self.turns += 1
        m = GUESS.search(turn)
        guess = int(m.group(1)) if m else -1
        if guess == self.target:
            return Step("", 1.0, True, {"turns": self.turns})
        if self.turns >= self.max_turns:
            return Step("", 0.0, True, {"turns": self.turns})
        return Step("<" if self.target < guess else ">", 0.0, False)
