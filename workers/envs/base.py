"""The environment interface of multi-turn rollouts, gymnasium-like: `reset` once per
trajectory, then `step` after each of the model's turns.

A trajectory alternates the model's turns (generated: trained on) and the environment's
observations (appended to the context with loss mask 0, no model version). Between turns the
trajectory holds no GPU and may continue on another instance, which rebuilds the environment
by `reset` and replaying the earlier turns through `step`: an environment must be a
deterministic function of (prompt, meta, turns so far). Its rewards are summed into the
trajectory's reward when it ends (`done`, or the turn or token limit).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.reward.sources import load_function


@dataclass
class Step:
    """What the environment answers to one of the model's turns."""

    observation: str  # appended to the context before the next turn ("" when done)
    reward: float = 0.0  # this turn's contribution to the trajectory's reward
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    def reset(self, prompt: str, meta: dict[str, Any]) -> str:
        """Start a trajectory; the observation appended after the prompt ("" for none)."""
        ...

    def step(self, turn: str) -> Step:
        """The model's turn (its text, stop string included) in, the environment's answer out.
        A step may also return the gymnasium tuple (observation, reward, done, info)."""
        ...


EnvFactory = Callable[[], Env]


class Codec(Protocol):
    """Text <-> token ids for environments: the engine's tokenizer, or a task's own."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


class BytesCodec:
    """UTF-8 bytes as token ids 0..255 (the tiny model's default, as the reward worker's)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode(errors="replace")


def load_codec(spec: str | None) -> Codec:
    """`module:ClassOrFactory` making an object with encode/decode; None: UTF-8 bytes."""
    if spec is None:
        return BytesCodec()
    codec = load_function(spec)()
    if not (callable(getattr(codec, "encode", None)) and callable(getattr(codec, "decode", None))):
        raise ValueError(f"{spec!r} is not a codec: it needs encode(text) and decode(tokens)")
    out: Codec = codec
    return out


class EnvFailed(Exception):
    """The environment raised, answered with something that is not a step, or timed out:
    `reason` is the drop reason its trajectory is recorded with."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def as_step(got: Any) -> Step:
    if isinstance(got, Step):
        return got
    if isinstance(got, tuple) and len(got) == 4:
        obs, reward, done, info = got
        if isinstance(obs, str) and isinstance(reward, (int, float)) and isinstance(done, bool):
            return Step(obs, float(reward), done, dict(info or {}))
    raise TypeError(f"step returned {type(got).__name__}, not a Step or (observation, reward, done, info)")


class Runner:
    """Calls an environment beside the engine, each call bounded by `timeout_s`: an exception,
    a bad answer or a timeout is an EnvFailed (`env_failed` / `env_timeout`). A hung call's
    thread is abandoned (Python cannot kill it); the trajectory is dropped either way. A step
    may run in the background (`step_async` / `step_answer`) while the engine decodes others;
    the pool is wide enough that a call seldom waits for a thread (its wait counts)."""

    def __init__(self, factory: EnvFactory, timeout_s: float = 10.0, max_workers: int = 32):
        self.factory, self.timeout_s = factory, timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="env")

    def _result(self, fut: concurrent.futures.Future[Any], timeout: float) -> Any:
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise EnvFailed("env_timeout", f"no answer in {self.timeout_s:g} s") from None
        except EnvFailed:
            raise
        except Exception as e:
            raise EnvFailed("env_failed", f"{type(e).__name__}: {e}"[:500]) from e

    def _call(self, fn: Callable[[], Any]) -> Any:
        return self._result(self._pool.submit(fn), self.timeout_s)

    def start(self, prompt: str, meta: dict[str, Any], turns: Sequence[str]) -> tuple[Env, str, float]:
        """A fresh environment replayed through the earlier `turns`: (env, reset observation,
        reward so far)."""

        def build() -> tuple[Env, str, float]:
            env = self.factory()
            first = env.reset(prompt, meta)
            if not isinstance(first, str):
                raise TypeError(f"reset returned {type(first).__name__}, not a str")
            total = sum(as_step(env.step(t)).reward for t in turns)
            return env, first, total

        got: tuple[Env, str, float] = self._call(build)
        return got

    def step_async(self, env: Env, turn: str) -> concurrent.futures.Future[Step]:
        """Start a step in the background; `step_answer` collects it."""
        return self._pool.submit(lambda: as_step(env.step(turn)))

    def step_answer(self, fut: concurrent.futures.Future[Step], waited_s: float) -> Step | None:
        """The step's answer, or None while it runs within `timeout_s` (raises EnvFailed)."""
        if not fut.done() and waited_s < self.timeout_s:
            return None
        return self._checked(self._result(fut, 0.0))

    def step(self, env: Env, turn: str) -> Step:
        return self._checked(self._result(self.step_async(env, turn), self.timeout_s))

    @staticmethod
    def _checked(step: Step) -> Step:
        if not step.done and not step.observation:
            raise EnvFailed("env_failed", "a step that is not done must answer with an observation")
        return step

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def load_env(spec: str) -> EnvFactory:
    """`module:ClassOrFactory` (as `--reward module:function`): called with no arguments for
    each trajectory, it returns an environment."""
    factory: EnvFactory = load_function(spec)
    return factory


def split_turns(text_of: Callable[[Sequence[int]], str], tokens: Sequence[int], mask: Sequence[int]) -> list[str]:
    """The model's turns in a response: the generated stretches (mask 1) between observations."""
    turns: list[str] = []
    run: list[int] = []
    for t, m in zip(tokens, mask, strict=True):
        if m:
            run.append(t)
        elif run:
            turns.append(text_of(run))
            run = []
    if run:
        turns.append(text_of(run))
    return turns
