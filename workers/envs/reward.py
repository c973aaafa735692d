"""The reward of a multi-turn trajectory: its environment's rewards, summed. The reward
worker replays the trajectory's turns (its generated stretches, split at the observations by
the loss mask) through a fresh environment, the same deterministic function of (prompt, meta,
turns) the rollout instances stepped."""

from __future__ import annotations

from collections.abc import Sequence

from workers.reward.sources import Outcome, RewardSample, Scored

from .base import Codec, EnvFactory, Runner, split_turns


class EnvReward:
    def __init__(self, factory: EnvFactory, codec: Codec, name: str = "env", timeout_s: float = 10.0):
        self.description = f"environment {name}"
        self.codec, self.runner = codec, Runner(factory, timeout_s)

    async def score(self, samples: Sequence[RewardSample], timeout: float) -> list[Outcome]:
        out: list[Outcome] = []
        for s in samples:
            try:
                mask = s.response_mask or [1] * len(s.response_tokens)
                turns = split_turns(self.codec.decode, s.response_tokens, mask)
                _, _, total = self.runner.start(self.codec.decode(s.prompt_tokens), s.meta, turns)
                out.append(Scored(total, {"turns": float(len(turns))}))
            except Exception as e:
                out.append(e)
        return out

    async def aclose(self) -> None:
        self.runner.close()
