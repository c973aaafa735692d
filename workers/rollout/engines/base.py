"""The rollout-engine interface shared by every engine (`torch`, `sim`, `vllm`).

Engine-agnostic on purpose: plain dataclasses (and the wire's `Capacity`), no torch import,
so the rollout worker, the cost-model `sim` engine and tests can use it without loading a
deep-learning stack.

Vocabulary (see SPEC.md): a sample's response is built from *segments*; one call to
`add_request` ... `Finished`/`interrupt` is one *stretch* on this engine and becomes one
segment. `prefix_tokens` are the response tokens of earlier segments: the engine continues
after them and never re-emits them.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.wire.models.rollout import Capacity


@dataclass(frozen=True)
class TokensEvent:
    """New tokens of one running sample in this step (one per decode iteration)."""

    sample_id: str
    tokens: list[int]
    logprobs: list[float]


FINISH_REASONS = ("eos", "length", "capacity", "abort", "error", "repetition")


@dataclass(frozen=True)
class FinishedEvent:
    """A sample finished. `tokens`/`logprobs` cover this stretch only (after the prefix).

    finish_reason: one of FINISH_REASONS: "eos" (EOS sampled; it is included in `tokens`),
    "length" (max_new_tokens or the model's max sequence reached) or "capacity" (the sample
    alone no longer fits in the KV cache); engines that can stop a sample on their own also
    report "abort" (the engine dropped it, not our interrupt/abort), "error" (a request-level
    engine failure) or "repetition" (the engine's repetition detector). The response ends
    there with the tokens so far, like any other finish.
    """

    sample_id: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    prefix_len: int = 0


@dataclass(frozen=True)
class PreemptedEvent:
    """KV capacity ran out: a running sample went back to the waiting queue.

    Its generated tokens are kept; it is recomputed (prefilled again) when readmitted.
    `waiting` is the waiting-queue length right after the preemption (counting this
    sample): the rollout worker applies the `φ_wait` migration rule to it
    (`engine_should_interrupt_preempted`) and interrupts the sample instead.
    """

    sample_id: str
    num_tokens: int
    waiting: int


def engine_should_interrupt_preempted(waiting_after_preemption: int, phi_wait: int | None) -> bool:
    """Engine-side migration rule (φ_wait): a sample the engine just preempted is interrupted
    back to the central queue (to be re-routed anywhere) instead of waiting on this engine
    when the engine's waiting queue — counting the preempted sample — exceeds φ_wait.
    `None` disables the rule (the sample waits, as in plain vLLM)."""
    return phi_wait is not None and waiting_after_preemption > phi_wait


EngineEvent = TokensEvent | FinishedEvent | PreemptedEvent


@dataclass(frozen=True)
class Partial:
    """What `interrupt` returns: the stretch so far (excluding the prefix it started from)."""

    sample_id: str
    tokens: list[int]
    logprobs: list[float]
    prefix_len: int = 0


@dataclass(frozen=True)
class EngineStats:
    """What a rollout worker heartbeats into its snapshot (SPEC §4 step 1)."""

    version: int
    running: int
    waiting: int
    kv_tokens: int  # tokens whose K/V are held in the cache right now (of `Engine.capacity`'s)
    # per running sample: prompt + response tokens so far (the routing length `l`)
    running_tokens: dict[str, int] = field(default_factory=dict)
    tokens_per_s: float = 0.0  # generated tokens per second over a recent window
    preemptions: int = 0  # total since start


def request_context(
    held: bool, sample_id: str, prompt_tokens: Sequence[int], prefix_tokens: Sequence[int]
) -> list[int]:
    """The argument checks an engine's `add_request` makes before queueing (`held`: the engine
    already holds `sample_id`); returns the context, prompt then prefix, as ints."""
    if held:
        raise ValueError(f"sample {sample_id!r} already in the engine")
    if not prompt_tokens:
        raise ValueError("empty prompt")
    return [int(t) for t in prompt_tokens] + [int(t) for t in prefix_tokens]


class Engine(abc.ABC):
    """One rollout instance's inference engine, driven by a single caller thread.

    Continuous batching: `add_request` queues a sample (waiting); each `step()` admits
    waiting samples while KV room exists, runs one decode iteration for every running
    sample and returns what happened. Sampling is deterministic given (weights, seed,
    tokens so far) for engines that can promise it, so a sample interrupted here and
    continued elsewhere with the same weights yields the same sequence.
    """

    bucket_bytes: int | None = None  # what a pull from the PS holds at a time (None: the client's default)

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Model version of the currently loaded weights."""

    @abc.abstractmethod
    def add_request(
        self,
        sample_id: str,
        prompt_tokens: Sequence[int],
        prefix_tokens: Sequence[int] = (),
        prefix_logprobs: Sequence[float] = (),
        max_new_tokens: int = 256,
        seed: int = 0,
    ) -> None:
        """Queue a sample. `prefix_*` continue an interrupted sample; `max_new_tokens`
        bounds this stretch (callers pass the response budget minus len(prefix))."""

    @abc.abstractmethod
    def step(self) -> list[EngineEvent]:
        """One scheduling + decode iteration. Returns [] when there is nothing to do."""

    @abc.abstractmethod
    def interrupt(self, sample_ids: Sequence[str]) -> list[Partial]:
        """Stop running/waiting samples, returning their stretch so far; unknown ids are
        skipped. The samples are dropped from the engine."""

    @abc.abstractmethod
    def abort(self, sample_ids: Sequence[str]) -> None:
        """Drop samples without returning anything (unknown ids are ignored)."""

    @abc.abstractmethod
    def load_weights(self, state_dict: Mapping[str, Any] | None, version: int) -> None:
        """Install new weights (None: the engine streams `version` from the parameter server,
        see load_from_ps). Running samples keep going on them; callers that want one version
        per segment interrupt first."""

    def load_from_ps(self, version: int | None = None, wait_s: float = 0.0) -> int:
        """Stream `version` (the latest committed if None or not served) from the parameter
        server into the model and install it; returns the version loaded. `wait_s`: how long
        to wait for a PS that is not up or has nothing committed yet (the first load)."""
        raise NotImplementedError(f"{type(self).__name__} does not load weights from a parameter server")

    def weight_source(self, target: int | None) -> tuple[None, int]:
        """The rollout worker's weight source for an engine that pulls from the PS itself: no
        tensors cross the worker, load_weights(None, target) streams `target`. Without a
        target the latest committed version is loaded here."""
        return None, (self.load_from_ps(None) if target is None else int(target))

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """Current load, for snapshots and the coordinator's cost model."""

    @abc.abstractmethod
    def capacity(self) -> Capacity:
        """What the engine holds at once: its running slots and its KV cache in tokens. The
        rollout worker registers and heartbeats it; the coordinator never routes the instance
        more requests than `max_running` (docs/coordinator.md#capacity)."""

    def has_work(self) -> bool:
        s = self.stats()
        return s.running + s.waiting > 0
