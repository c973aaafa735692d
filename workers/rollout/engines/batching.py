"""Continuous batching shared by the engines that run the model in-process (`torch`, `hf`).

`BatchingEngine` owns the request bookkeeping and vLLM-style scheduling: FIFO admission
while `max_running` and the KV budget allow, preemption by recompute of the most recently
admitted sample when decoding runs out of room, interrupt/abort returning or dropping the
stretch so far, and the step loop that samples one token per running sample and emits the
events. A subclass supplies the model and its KV cache: the logits of one step
(`_logits`) and the KV accounting hooks (`_kv_*`), on the per-request handle `Request.cache`.

Sampling is `tiny_model.sample_tokens` (one uniform per (seed, position)), so a sample's
tokens depend only on the weights, its seed and its tokens so far: that is what makes an
interrupted sample continued from its partial reproduce an uninterrupted run.
"""

from __future__ import annotations

import abc
import collections
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from workers.models.tiny_model import sample_tokens
from workers.rollout.engines.base import (
    Engine,
    EngineEvent,
    EngineStats,
    FinishedEvent,
    Partial,
    PreemptedEvent,
    TokensEvent,
    request_context,
)
from workers.trainer.param_store import tensors_of
from workers.wire.models.rollout import Capacity

C = TypeVar("C")  # an engine's per-sample KV handle


def limit_cpu_threads(num_threads: int | None, device: str | torch.device) -> None:
    """Process-wide torch setting, made before the model loads. A small model's ops are far
    too small for intra-op threads to help; on a shared CPU they spin and slow decoding
    several-fold. None leaves the setting alone (a bigger model, an embedding process)."""
    if num_threads is not None and torch.device(device).type == "cpu":
        torch.set_num_threads(num_threads)


@dataclass(eq=False)  # identity: the queues remove by it, and caches may hold tensors
class Request(Generic[C]):
    sample_id: str
    context: list[int]  # prompt + prefix: what this stretch starts from
    prefix_len: int
    max_new: int
    seed: int
    gen: list[int] = field(default_factory=list)  # this stretch's tokens
    gen_lp: list[float] = field(default_factory=list)
    cache: C | None = None  # K/V of all tokens but the last sampled one; None while waiting

    @property
    def seq_len(self) -> int:
        return len(self.context) + len(self.gen)

    def tokens(self) -> list[int]:
        return self.context + self.gen

    @property
    def held(self) -> C:
        """The cache of a sample that has been prefilled, which always holds one."""
        assert self.cache is not None, f"{self.sample_id} holds no KV cache"
        return self.cache


class BatchingEngine(Engine, Generic[C]):
    """The scheduling half of an in-process engine; see the module docstring."""

    model: Any  # loaded by `load_weights` by state-dict name
    ps: Any = None  # a ParamClient: load_weights(None, v) streams v from it (the CLI sets it)

    def __init__(
        self,
        *,
        version: int,
        max_running: int,
        temperature: float,
        vocab_size: int,
        max_seq: int | None,
        eos: Collection[int],
    ):
        self.max_running = max_running
        self.temperature = temperature
        self.vocab_size = vocab_size
        self.max_seq = max_seq  # None: the model states no limit
        self.eos = eos
        self._version = version
        self._running: list[Request[C]] = []  # admission order
        self._waiting: collections.deque[Request[C]] = collections.deque()
        self._finished_early: list[FinishedEvent] = []
        self._preemptions = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=32)
        self._torn = False  # a load began and did not complete: no step runs on such weights

    # ---- what an engine supplies ---------------------------------------------------------
    @abc.abstractmethod
    def _logits(self, decoding: list[Request[C]], admitted: list[Request[C]]) -> torch.Tensor:
        """Next-token logits (len(decoding) + len(admitted), V), in that order: one decode
        step for each running sample, a prefill of each newly admitted one. Grows caches."""

    @abc.abstractmethod
    def _kv_fits_alone(self, n_tokens: int) -> bool:
        """Whether one sample of `n_tokens` fits in an otherwise empty cache."""

    @abc.abstractmethod
    def _kv_fits_decode(self) -> bool:
        """Whether every running sample's next token fits in the cache."""

    @abc.abstractmethod
    def _kv_admit(self, r: Request[C]) -> bool:
        """Make room for the waiting sample's `seq_len` tokens; False if there is none."""

    @abc.abstractmethod
    def _kv_release(self, r: Request[C]) -> None:
        """Free what the sample holds (if anything) and set its `cache` to None."""

    @abc.abstractmethod
    def _kv_usage(self) -> tuple[int, int]:
        """(tokens held in the cache, tokens it can hold)."""

    def _kv_reserve_decode(self) -> None:
        """Once `_kv_fits_decode` holds: reserve the running samples' next slots."""

    # ---- interface ---------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def add_request(
        self,
        sample_id: str,
        prompt_tokens: Sequence[int],
        prefix_tokens: Sequence[int] = (),
        prefix_logprobs: Sequence[float] = (),
        max_new_tokens: int = 256,
        seed: int = 0,
    ) -> None:
        context = request_context(self._find(sample_id) is not None, sample_id, prompt_tokens, prefix_tokens)
        if prefix_logprobs and len(prefix_logprobs) != len(prefix_tokens):
            raise ValueError("prefix_logprobs and prefix_tokens differ in length")
        if not all(0 <= t < self.vocab_size for t in context):
            raise ValueError("token id out of vocabulary")
        if (self.max_seq is not None and len(context) >= self.max_seq) or max_new_tokens <= 0:
            # nothing may be generated: report it as finished on the next step
            self._finished_early.append(FinishedEvent(sample_id, [], [], "length", len(prefix_tokens)))
            return
        if not self._kv_fits_alone(len(context) + 1):
            raise ValueError(f"{len(context)} context tokens never fit the KV cache")
        self._waiting.append(Request(sample_id, context, len(prefix_tokens), max_new_tokens, seed))

    def step(self) -> list[EngineEvent]:
        if self._torn:
            raise RuntimeError(f"weights torn by a failed load (still version {self._version}): load a version first")
        t0 = time.perf_counter()
        events: list[EngineEvent] = list(self._finished_early)
        self._finished_early.clear()
        preempted = self._make_room_for_decode(events)
        decoding = list(self._running)
        admitted = [] if preempted else self._admit()
        if not decoding and not admitted:
            return events
        logits = self._logits(decoding, admitted)
        batch = decoding + admitted
        new_tok, new_lp = sample_tokens(logits, [r.seed for r in batch], [r.seq_len for r in batch], self.temperature)
        for r, t, lp in zip(batch, new_tok, new_lp):
            r.gen.append(t)
            r.gen_lp.append(lp)
            events.append(TokensEvent(r.sample_id, [t], [lp]))
            if t in self.eos:
                self._finish(r, "eos", events)
            elif len(r.gen) >= r.max_new or (self.max_seq is not None and r.seq_len >= self.max_seq):
                self._finish(r, "length", events)
        self._recent.append((time.perf_counter() - t0, len(batch)))
        return events

    def interrupt(self, sample_ids: Sequence[str]) -> list[Partial]:
        out = []
        for sid in sample_ids:
            r = self._drop(sid)
            if r is not None:
                out.append(Partial(sid, list(r.gen), list(r.gen_lp), r.prefix_len))
        return out

    def abort(self, sample_ids: Sequence[str]) -> None:
        for sid in sample_ids:
            self._drop(sid)

    def load_weights(self, state_dict: Mapping[str, Any] | None, version: int) -> None:
        """Install `state_dict` as `version`; None: stream `version` from the PS (`ps`)."""
        if state_dict is None:
            self.load_from_ps(version)
        else:
            self.install(int(version), iter(state_dict.items()))

    def install(self, version: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy each (name, tensor) into the model's parameter or buffer of that state-dict
        name, in place, as it comes (device and dtype conversion included): no second copy
        of the model. `version` becomes the engine's only once `tensors` ran out and every
        name arrived; until then the weights are torn and step() refuses to run, so a load
        that fails is retried or ends the worker, and nothing is generated on torn weights.
        K/V already cached stay as computed by the old weights, as in vLLM."""
        targets = self.model.state_dict(keep_vars=True)
        missing = set(targets)
        self._torn = True
        with torch.no_grad():
            for name, t in tensors:
                dst = targets.get(name)
                if dst is None:
                    raise KeyError(f"weight {name!r}: the model has no such parameter or buffer")
                if dst.shape != t.shape:  # copy_ would broadcast
                    raise ValueError(f"weight {name!r}: shape {tuple(t.shape)}, the model's is {tuple(dst.shape)}")
                dst.copy_(t)
                missing.discard(name)
        if missing:
            raise KeyError(f"version {version} lacks weights of the model: {sorted(missing)[:5]}")
        self._version = int(version)
        self._torn = False

    def load_from_ps(self, version: int | None = None, wait_s: float = 0.0) -> int:
        if self.ps is None:
            raise RuntimeError("no parameter server to load weights from: set the engine's ps")
        kw = {} if self.bucket_bytes is None else {"bucket_bytes": self.bucket_bytes}
        device = next(iter(self.model.state_dict().values())).device
        got, _ = self.ps.pull_served(
            lambda v, received: self.install(v, tensors_of(received)), version, wait_s=wait_s, device=device, **kw
        )
        return int(got)

    def stats(self) -> EngineStats:
        busy = sum(d for d, _ in self._recent)
        held, _ = self._kv_usage()
        return EngineStats(
            version=self._version,
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens=held,
            running_tokens={r.sample_id: r.seq_len for r in self._running},
            # decode throughput while busy, i.e. n / latency(n, kv) of the cost model
            tokens_per_s=sum(n for _, n in self._recent) / busy if busy > 0 else 0.0,
            preemptions=self._preemptions,
        )

    def capacity(self) -> Capacity:
        return Capacity(max_running=self.max_running, kv_capacity=self._kv_usage()[1])

    # ---- scheduling --------------------------------------------------------------------
    def _make_room_for_decode(self, events: list[EngineEvent]) -> bool:
        """Each running sample's next token needs one more KV slot: preempt the most recently
        admitted samples until that fits. Returns whether anything was preempted."""
        preempted: list[Request[C]] = []
        while self._running and not self._kv_fits_decode():
            victim = self._running[-1]
            if len(self._running) == 1:  # alone and still no room: it can never finish
                self._finish(victim, "capacity", events)
                continue
            self._running.pop()
            self._kv_release(victim)
            preempted.append(victim)
            self._preemptions += 1
        # back to the head of the queue, oldest first, generated tokens kept (recompute)
        for r in preempted:
            self._waiting.appendleft(r)
        for r in reversed(preempted):
            events.append(PreemptedEvent(r.sample_id, r.seq_len, len(self._waiting)))
        self._kv_reserve_decode()
        return bool(preempted)

    def _admit(self) -> list[Request[C]]:
        admitted = []
        while self._waiting and len(self._running) < self.max_running:
            r = self._waiting[0]
            if not self._kv_admit(r):
                break  # FIFO: do not let short requests overtake (no starvation)
            self._waiting.popleft()
            self._running.append(r)
            admitted.append(r)
        return admitted

    def _finish(self, r: Request[C], reason: str, events: list[EngineEvent]) -> None:
        self._drop(r.sample_id)
        events.append(FinishedEvent(r.sample_id, list(r.gen), list(r.gen_lp), reason, r.prefix_len))

    def _find(self, sid: str) -> Request[C] | None:
        for r in self._running:
            if r.sample_id == sid:
                return r
        for r in self._waiting:
            if r.sample_id == sid:
                return r
        return None

    def _drop(self, sid: str) -> Request[C] | None:
        r = self._find(sid)
        if r is None:
            return None
        if r in self._running:
            self._running.remove(r)
        else:
            self._waiting.remove(r)
        self._kv_release(r)
        return r
