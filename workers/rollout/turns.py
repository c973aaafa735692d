"""Multi-turn rollouts on the instance: the environment beside the engine.

A routed trajectory's environment is rebuilt from its prompt, meta and earlier turns (the
prefix, split at the observations by its loss mask), so a trajectory continues on any
instance. When the engine ends a turn, the environment answers: done (or no room left), the
turn is the trajectory's last segment; otherwise the turn is reported, then the observation
(not generated: loss mask 0, no version), and the trajectory goes back to the queue, holding
no GPU while it waits to be routed for its next turn."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.envs.base import Codec, Env, EnvFactory, Runner, Step, split_turns


@dataclass
class Turn:
    """How a turn ended: the environment's step and its observation's tokens."""

    step: Step
    observation: list[int]


def turn_start(mask: Sequence[int]) -> int:
    """Where the current turn begins in a prefix: after its last observation token."""
    for i in range(len(mask) - 1, -1, -1):
        if not mask[i]:
            return i + 1
    return 0


class Turns:
    def __init__(self, factory: EnvFactory, codec: Codec, timeout_s: float = 10.0):
        self.runner, self.codec = Runner(factory, timeout_s), codec
        self.envs: dict[int, Env] = {}

    def start(
        self, sample_id: int, prompt: Sequence[int], prefix: Sequence[int], mask: Sequence[int], meta: dict[str, Any]
    ) -> list[int]:
        """The trajectory's environment, replayed through its earlier turns; returns the reset
        observation's tokens when the trajectory is fresh (to append first), else []. Raises
        EnvFailed."""
        turns = split_turns(self.codec.decode, prefix, mask or [1] * len(prefix))
        if prefix and (not mask or mask[-1]):
            turns = turns[:-1]  # the last stretch is the current turn, interrupted: not stepped yet
        env, first, _ = self.runner.start(self.codec.decode(prompt), meta, turns)
        self.envs[sample_id] = env
        return self.codec.encode(first) if not prefix and first else []

    def end(self, sample_id: int, turn: Sequence[int]) -> Turn:
        """The environment's answer to the model's turn (raises EnvFailed)."""
        step = self.runner.step(self.envs[sample_id], self.codec.decode(turn))
        return Turn(step, [] if step.done else self.codec.encode(step.observation))

    def forget(self, sample_id: int) -> None:
        self.envs.pop(sample_id, None)

    def close(self) -> None:
        self.runner.close()
