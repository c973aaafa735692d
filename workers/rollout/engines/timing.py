"""One batching and timing model of a rollout instance, on the cost-model clock.

Both the simulator's `SimInstance` (event-driven clock) and the live `sim` engine
(`SimEngine`, scaled real time) run this model, so the simulator and the real service
compare policies on the same engine. Callers own the clock; this class owns the batch.

Continuous batching: a decode iteration of `n` running samples holding `kv` KV tokens takes
`cost.latency(n, kv)`; every running sample gains one token per iteration, so KV grows by n
per iteration and k iterations take `cost.iterations_time(n, kv, k)` (docs/coordinator.md).

Running samples are kept as *offsets* from the iteration counter `it`: a sample admitted at
iteration it0 with g tokens finishes at `finish_it = it0 + (target - g)` and holds
`ctx = off_ctx + it` KV tokens, so advancing k iterations is `it += k` — O(1) whatever the
batch — and the next finish is the top of a heap (entries of samples that left are skipped).

Admission: first come first served from the waiting queue, while a running slot is free and
the context (prompt + tokens so far) fits below capacity minus a watermark (vLLM's: the
batch can still decode afterwards, so admission and preemption never chase each other).
Prefill work: an admitted context of `ctx` tokens costs `ctx + attn_coef·ctx²` token-equivalents
of the caller's prefill rate: the weights' 2·N FLOPs per token, plus causal attention over the
context (Kaplan et al. 2020, C_forward = 2N + 2·n_layer·n_ctx·d_attn per token; summed over a
causal prefill of ctx tokens, n_layer·d_attn·ctx²), so `attn_coef = n_layer·d_attn / (2·N)`.
Resuming a long interrupted sample costs more per token than a fresh prompt.
Preemption: when not one more iteration fits, the most recently admitted sample leaves the
batch with the tokens it has — back to the front of the waiting queue (recomputed when
readmitted, as vLLM does) or, by the φ_wait rule, off the engine.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any, Protocol

from workers.coordinator.cost_model import CostModel
from workers.rollout.engines.base import engine_should_interrupt_preempted


class Lengths(Protocol):
    """Per-sample token counts owned by the caller (lists or dicts indexed by sample id)."""

    prompt: Any  # prompt tokens
    gen: Any  # response tokens generated; updated when the sample leaves the batch
    target: Any  # response length at which it finishes


class BatchModel:
    def __init__(self, cost: CostModel, kv_capacity: int, max_running: int, lengths: Lengths, attn_coef: float = 0.0):
        self.cost = cost
        self.attn_coef = attn_coef
        self.cap = int(kv_capacity)
        self.max_running = int(max_running)
        self.lengths = lengths
        self.watermark = max(self.cap // 100, self.max_running + 1)
        self.it = 0
        self.run: dict[Any, list[int]] = {}  # sid -> [finish_it, off_ctx, off_gen]; admission order
        self.heap: list[tuple[int, Any]] = []
        self.S = 0  # sum of off_ctx over running samples: kv = S + n·it
        self.waiting: deque[Any] = deque()
        self.preemptions = 0

    @property
    def n(self) -> int:
        return len(self.run)

    @property
    def kv(self) -> int:
        return self.S + len(self.run) * self.it

    def context(self, sid: Hashable) -> int:
        """KV tokens a running sample holds."""
        return self.run[sid][1] + self.it

    # ---- samples in and out ----------------------------------------------------------------

    def _remove_running(self, sid: Any) -> None:
        r = self.run.pop(sid)
        self.lengths.gen[sid] = r[2] + self.it
        self.S -= r[1]

    def remove(self, sids: Iterable[Any]) -> list[Any]:
        """Take samples out (running or waiting) with the tokens they have; returns those held."""
        out = []
        drop = set()
        for sid in sids:
            if sid in self.run:
                self._remove_running(sid)
                out.append(sid)
            elif sid in self.waiting:
                drop.add(sid)
                out.append(sid)
        if drop:
            self.waiting = deque(s for s in self.waiting if s not in drop)
        if not self.run:
            self.heap.clear()
        return out

    def admit(self) -> float:
        """Admit waiting samples that fit; returns the prefill to do, in token-equivalents
        (their context tokens plus the attention term, module docstring)."""
        lens, run, heap, waiting = self.lengths, self.run, self.heap, self.waiting
        n = len(run)
        kv = self.S + n * self.it
        limit = self.cap - self.watermark
        prefill = 0.0
        attn = self.attn_coef
        while waiting and n < self.max_running:
            sid = waiting[0]
            g = lens.gen[sid]
            ctx = lens.prompt[sid] + g
            if kv + ctx > limit and n > 0:
                break
            waiting.popleft()
            fi = self.it + (lens.target[sid] - g)
            off_ctx = ctx - self.it
            run[sid] = [fi, off_ctx, g - self.it]
            self.S += off_ctx
            heapq.heappush(heap, (fi, sid))
            n += 1
            kv += ctx
            prefill += ctx + attn * ctx * ctx
        return prefill

    def preempt(self, phi_wait: int | None = None) -> tuple[Any, bool]:
        """Preempt the most recently admitted sample: (its id, whether φ_wait took it off the
        engine — otherwise it waits at the front of the queue)."""
        sid = next(reversed(self.run))
        self._remove_running(sid)
        self.preemptions += 1
        if engine_should_interrupt_preempted(len(self.waiting) + 1, phi_wait):
            return sid, True
        self.waiting.appendleft(sid)
        return sid, False

    # ---- decoding --------------------------------------------------------------------------

    def room(self) -> int:
        """Iterations the KV cache still has room for (<= 0: preempt first)."""
        n = len(self.run)
        return (self.cap - self.S - n * self.it) // n

    def to_finish(self) -> int:
        """Iterations until the next running sample finishes."""
        heap, run = self.heap, self.run
        while heap:
            fi, sid = heap[0]
            r = run.get(sid)
            if r is not None and r[0] == fi:
                return fi - self.it
            heapq.heappop(heap)
        raise RuntimeError("running samples but an empty finish heap")

    def time(self, k: int) -> float:
        """Seconds for the next k iterations of the current batch."""
        n = len(self.run)
        return self.cost.iterations_time(n, self.S + n * self.it, k)

    def within(self, budget: float) -> int:
        """The most whole iterations of the current batch that fit in `budget` seconds."""
        n = len(self.run)
        return self.cost.iterations_within(n, self.S + n * self.it, budget)

    def decode(self, k: int) -> list[Any]:
        """Run k iterations (k <= to_finish()); returns the samples that finished, in order."""
        self.it += k
        heap, run, it, lens = self.heap, self.run, self.it, self.lengths
        done = []
        while heap and heap[0][0] <= it:
            fi, sid = heapq.heappop(heap)
            r = run.get(sid)
            if r is None or r[0] != fi:
                continue
            del run[sid]
            self.S -= r[1]
            lens.gen[sid] = lens.target[sid]
            done.append(sid)
        return done
