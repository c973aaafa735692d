"""Multi-turn rollouts on the instance: the environment beside the engine.

A routed trajectory's environment is rebuilt from its prompt, meta and earlier turns (the
prefix, split at the observations by its loss mask), so a trajectory continues on any
instance. When the engine ends a turn, the environment steps in the background (`begin`; the
engine decodes the others meanwhile) and the instance holds the trajectory, with no decode
slot, until it answers (`answer`): done (or no room left), the turn is the trajectory's last
segment; otherwise the turn is reported, then the observation (not generated: loss mask 0, no
version), and the trajectory goes back to the queue, holding no GPU while it waits to be
routed for its next turn."""

from __future__ import annotations

import concurrent.futures
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
        # trajectories waiting for their environment: (its step in flight, when it began)
        self.calls: dict[int, tuple[concurrent.futures.Future[Step], float]] = {}

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

    def begin(self, sample_id: int, turn: Sequence[int], now: float) -> None:
        """Hand the model's turn to the environment; `answer` collects its reply."""
        fut = self.runner.step_async(self.envs[sample_id], self.codec.decode(turn))
        self.calls[sample_id] = (fut, now)

    def answer(self, sample_id: int, now: float) -> Turn | None:
        """The environment's answer to the turn begun, or None while it works (raises
        EnvFailed: failed, or no answer within the runner's timeout)."""
        fut, since = self.calls[sample_id]
        step = self.runner.step_answer(fut, now - since)
        if step is None:
            return None
        del self.calls[sample_id]
        return Turn(step, [] if step.done else self.codec.encode(step.observation))

    def env_since(self, sample_id: int) -> float | None:
        """When the trajectory's environment call began (None: it is not waiting for one)."""
        call = self.calls.get(sample_id)
        return None if call is None else call[1]

    def forget(self, sample_id: int) -> None:
        self.envs.pop(sample_id, None)
        self.calls.pop(sample_id, None)

    def close(self) -> None:
        self.runner.close()
