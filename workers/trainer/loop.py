"""The trainer's loop, shared by the torch trainer and the sim trainer (torch-free).

One step: wait for the ready buffer of the current version (`consume_ready`), train on it,
publish the next version fenced by the consume fence (`publish_fenced`); `run_steps` repeats
that until asked to stop, and `StepMetrics` is what each step reports.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from workers.client import StaleFlowClient
from workers.wire.models import BatchOut

log = logging.getLogger("staleflow.trainer")


class TrainerError(RuntimeError):
    """The trainer cannot continue safely (state mismatch); the message says why."""


def check_start(run_id: int, run_version: int, has_run_weights: bool, missing: str, remedy: str) -> None:
    """The rule every trainer applies before its first step (`staleflow trainer`, the SDK): a
    run past version 0 trains on from the weights of its version, never from fresh ones, which
    would publish version r + 1 trained from scratch as if it followed r. `missing` says what
    is not there, `remedy` what to do."""
    if run_version > 0 and not has_run_weights:
        raise TrainerError(f"run {run_id} is at version {run_version} but {missing}: {remedy}")


@dataclass
class StepMetrics:
    version: int  # the buffer trained: model `version` -> `version + 1`
    groups: int
    samples: int
    tokens: int  # prompt + response tokens
    response_tokens: int
    reward_mean: float
    staleness: dict[int, int]  # version - V_traj -> samples
    wait_s: float = 0.0  # long-polling for the ready buffer
    train_s: float = 0.0
    push_s: float = 0.0
    publish_s: float = 0.0
    loss: float | None = None
    checksum: str | None = None
    resumed: bool = False  # trained before a restart, published by this process
    extra: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        return out

    def line(self) -> str:
        stale = " ".join(f"{k}:{v}" for k, v in sorted(self.staleness.items()))
        loss = "" if self.loss is None else f" loss {self.loss:+.4f}"
        tag = " (resumed)" if self.resumed else ""
        return (
            f"v{self.version}->v{self.version + 1}{tag}: reward {self.reward_mean:.3f}{loss}"
            f" tokens {self.tokens} staleness [{stale}] wait {self.wait_s:.1f}s"
            f" train {self.train_s:.2f}s push {self.push_s:.2f}s"
        )


def batch_metrics(batch: BatchOut) -> StepMetrics:
    samples = [s for g in batch.groups for s in g.samples]
    prompt = sum(len(g.prompt_tokens) * len(g.samples) for g in batch.groups)
    response = sum(len(s.tokens) for s in samples)
    staleness = collections.Counter(batch.version - s.v_traj for s in samples)
    reward = sum(s.reward for s in samples) / len(samples) if samples else 0.0
    return StepMetrics(
        batch.version, len(batch.groups), len(samples), prompt + response, response, reward, dict(staleness)
    )


def consume_ready(
    client: StaleFlowClient, run_id: int, version: int, wait_s: float, stopping: Callable[[], bool]
) -> tuple[BatchOut | None, float]:
    """Long-poll until buffer `version` is ready (or we are told to stop)."""
    t0 = time.monotonic()
    while not stopping():
        batch = client.consume(run_id, version, wait=wait_s)
        if batch is not None:
            return batch, time.monotonic() - t0
    return None, time.monotonic() - t0


def publish_fenced(client: StaleFlowClient, run_id: int, version: int, consume_fence: int, **params: Any) -> int:
    """Publish buffer `version`; a 409 means this trainer was fenced (another consume took the
    buffer, or another trainer published it): stop rather than train on, since the weights it
    pushed are not the published ones."""
    from workers.client import Conflict

    try:
        return client.publish(run_id, version, consume_fence, **params)
    except Conflict as e:
        now = client.run_status(run_id).version
        if now > version:
            raise TrainerError(f"fenced: another trainer published version {version + 1} ({e.message})") from None
        raise TrainerError(f"fenced: another trainer consumed buffer {version} ({e.message})") from None


def run_steps(
    step: Callable[[], StepMetrics | None],
    stopping: Callable[[], bool],
    steps: int | None,
    on_step: Callable[[StepMetrics], None] | None = None,
    done: list[StepMetrics] | None = None,
) -> list[StepMetrics]:
    """The trainers' loop: call `step` until `stopping()` or `done` holds `steps` metrics,
    logging each and passing it to `on_step`. `step` returning None (stopped while waiting)
    counts nothing. `done` may be pre-filled (and is extended in place)."""
    done = [] if done is None else done
    while not stopping() and (steps is None or len(done) < steps):
        m = step()
        if m is not None:
            record_step(m, done, on_step)
    return done


def record_step(m: StepMetrics, done: list[StepMetrics], on_step: Callable[[StepMetrics], None] | None = None) -> None:
    done.append(m)
    log.info("%s", m.line())
    if on_step:
        on_step(m)
