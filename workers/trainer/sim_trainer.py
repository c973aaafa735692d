"""The *sim* trainer used by scale experiments (torch-free).

The sim trainer holds no weights. It consumes the ready buffer of its version, waits for
the time a real step would take under a tokens-proportional model

    t = (a + b · tokens) · time_scale         (tokens: prompt + response, all samples)

and publishes. Defaults: a = 10 s fixed overhead, b = 1.27e-5 s/token, i.e. 6 · 7e9 FLOP per
token on 64 GPUs at 148 TFLOP/s and 35 % MFU (the 7B dense set-up of docs/policies.md, as in
workers/sim/setups.py). A restart needs no checkpoint: an unpublished batch is consumed
again under a new consume fence.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from workers.client import StaleFlowClient
from workers.trainer.loop import StepMetrics, batch_metrics, consume_ready, publish_fenced, run_steps

SIM_OVERHEAD_S = 10.0
SIM_S_PER_TOKEN = 6.0 * 7e9 / (64 * 148e12 * 0.35)


class SimTrainer:
    def __init__(
        self,
        client: StaleFlowClient,
        run_id: int,
        *,
        overhead_s: float = SIM_OVERHEAD_S,
        s_per_token: float = SIM_S_PER_TOKEN,
        time_scale: float = 1.0,
        wait_s: float = 5.0,
    ):
        if overhead_s < 0 or s_per_token < 0 or time_scale < 0:
            raise ValueError("overhead_s, s_per_token and time_scale must be >= 0")
        self.client, self.run_id = client, run_id
        self.overhead_s, self.s_per_token, self.time_scale = overhead_s, s_per_token, time_scale
        self.wait_s = wait_s
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def step_time(self, tokens: int) -> float:
        return (self.overhead_s + self.s_per_token * tokens) * self.time_scale

    def step(self) -> StepMetrics | None:
        version = self.client.run_status(self.run_id).version
        batch, waited = consume_ready(self.client, self.run_id, version, self.wait_s, self._stop.is_set)
        if batch is None:
            return None
        m = batch_metrics(batch)
        m.wait_s = waited
        m.train_s = self.step_time(m.tokens)
        time.sleep(m.train_s)  # a started step always finishes, even when asked to stop
        t0 = time.monotonic()
        publish_fenced(self.client, self.run_id, version, batch.consume_fence)
        m.publish_s = time.monotonic() - t0
        return m

    def run(self, steps: int | None = None, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        return run_steps(self.step, self._stop.is_set, steps, on_step)
