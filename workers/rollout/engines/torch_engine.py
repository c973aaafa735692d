"""The `torch` rollout engine: continuous batching over `TinyTransformer` with a paged KV
cache of fixed capacity, vLLM-style scheduling (admit while room exists, preempt the
most recently admitted sample by recompute when it runs out).

Runs on CPU; pass device="cuda" to run on a GPU. See tiny_model.py for why a sample's
tokens do not depend on the batch it shares, which is what makes interrupt-and-continue
(on this or another instance with the same weights) reproduce an uninterrupted run.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.models.tiny_model import KVPool, SeqCache, TinyConfig, TinyTransformer, sample_tokens
from workers.rollout.engines.base import (
    Engine,
    EngineEvent,
    EngineStats,
    FinishedEvent,
    Partial,
    PreemptedEvent,
    TokensEvent,
)


@dataclass
class _Request:
    sample_id: str
    context: list[int]  # prompt + prefix: what this stretch starts from
    prefix_len: int
    max_new: int
    seed: int
    gen: list[int] = field(default_factory=list)  # this stretch's tokens
    gen_lp: list[float] = field(default_factory=list)
    cache: SeqCache | None = None  # holds K/V of all tokens but the last sampled one
    admitted: int = -1  # admission counter; the highest is preempted first

    @property
    def seq_len(self) -> int:
        return len(self.context) + len(self.gen)

    def tokens(self) -> list[int]:
        return self.context + self.gen

    @property
    def held(self) -> SeqCache:
        """The cache of an admitted (running) sample, which always holds one."""
        assert self.cache is not None, f"{self.sample_id} is not admitted"
        return self.cache


class TorchEngine(Engine):
    def __init__(
        self,
        config: TinyConfig = TinyConfig(),
        *,
        model: TinyTransformer | None = None,
        model_seed: int = 0,
        version: int = 0,
        kv_capacity_tokens: int = 8192,
        block_size: int = 16,
        max_running: int = 256,
        temperature: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = 1,
    ):
        # Process-wide torch setting. The tiny model's ops are far too small for intra-op
        # threads to help; on a shared CPU they spin and slow decoding several-fold.
        # None leaves the setting alone (for a bigger model or an embedding process).
        if num_threads is not None and torch.device(device).type == "cpu":
            torch.set_num_threads(num_threads)
        self.model = (model or TinyTransformer(config, seed=model_seed)).to(device=device, dtype=dtype)
        self.cfg = self.model.cfg
        self.pool = KVPool(self.cfg, kv_capacity_tokens, block_size, device=device, dtype=dtype)
        self.max_running = max_running
        self.temperature = temperature
        self._version = version
        self._running: list[_Request] = []  # admission order
        self._waiting: collections.deque[_Request] = collections.deque()
        self._finished_early: list[FinishedEvent] = []
        self._admissions = 0
        self._preemptions = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=32)

    # ---- interface -------------------------------------------------------------------
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
        if self._find(sample_id) is not None:
            raise ValueError(f"sample {sample_id!r} already in the engine")
        if not prompt_tokens:
            raise ValueError("empty prompt")
        if prefix_logprobs and len(prefix_logprobs) != len(prefix_tokens):
            raise ValueError("prefix_logprobs and prefix_tokens differ in length")
        context = [int(t) for t in prompt_tokens] + [int(t) for t in prefix_tokens]
        if not all(0 <= t < self.cfg.vocab_size for t in context):
            raise ValueError("token id out of vocabulary")
        if len(context) >= self.cfg.max_seq or max_new_tokens <= 0:
            # nothing may be generated: report it as finished on the next step
            self._finished_early.append(FinishedEvent(sample_id, [], [], "length", len(prefix_tokens)))
            return
        if self.pool.blocks_needed(len(context) + 1) > self.pool.num_blocks:
            raise ValueError(f"{len(context)} context tokens never fit the KV cache")
        self._waiting.append(_Request(sample_id, context, len(prefix_tokens), max_new_tokens, seed))

    def step(self) -> list[EngineEvent]:
        t0 = time.perf_counter()
        events: list[EngineEvent] = list(self._finished_early)
        self._finished_early.clear()
        preempted = self._make_room_for_decode(events)
        decoding = list(self._running)
        admitted = [] if preempted else self._admit()
        if not decoding and not admitted:
            return events
        # one forward for everything: one row per decoding sample, all context rows of
        # each newly admitted one (prefill); each sequence's last row gives its next token
        caches, positions, tokens, last_rows = [], [], [], []
        for r in decoding:
            caches.append(r.held)
            positions.append(r.held.length)
            tokens.append(r.gen[-1])
            last_rows.append(len(tokens) - 1)
        for r in admitted:
            toks = r.tokens()
            caches += [r.held] * len(toks)
            positions += range(len(toks))
            tokens += toks
            last_rows.append(len(tokens) - 1)
        logits = self.model.forward_rows(caches, positions, tokens)[last_rows]
        batch = decoding + admitted
        new_tok, new_lp = sample_tokens(logits, [r.seed for r in batch], [r.seq_len for r in batch], self.temperature)
        for r, t, lp in zip(batch, new_tok, new_lp):
            r.gen.append(t)
            r.gen_lp.append(lp)
            events.append(TokensEvent(r.sample_id, [t], [lp]))
            if t == self.cfg.eos_token_id:
                self._finish(r, "eos", events)
            elif len(r.gen) >= r.max_new or r.seq_len >= self.cfg.max_seq:
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

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        # copies into the existing parameters (device/dtype conversion included); K/V
        # already cached stay as computed by the old weights, as in vLLM
        self.model.load_state_dict(dict(state_dict), strict=True)
        self._version = int(version)

    def stats(self) -> EngineStats:
        busy = sum(d for d, _ in self._recent)
        return EngineStats(
            version=self._version,
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens=self.pool.tokens_held,
            kv_capacity=self.pool.capacity_tokens,
            running_tokens={r.sample_id: r.seq_len for r in self._running},
            # decode throughput while busy, i.e. n / latency(n, kv) of the cost model
            tokens_per_s=sum(n for _, n in self._recent) / busy if busy > 0 else 0.0,
            preemptions=self._preemptions,
        )

    # ---- scheduling --------------------------------------------------------------------
    def _make_room_for_decode(self, events: list[EngineEvent]) -> bool:
        """Reserve the slot each running sample's next token needs, preempting the most
        recently admitted samples until that fits. Returns whether anything was preempted."""
        preempted: list[_Request] = []
        while self._running:
            need = sum(r.held.extra_blocks(r.held.length + 1) for r in self._running)
            if need <= self.pool.free_blocks:
                break
            victim = self._running[-1]
            if len(self._running) == 1:  # alone and still no room: it can never finish
                self._finish(victim, "capacity", events)
                continue
            self._running.pop()
            victim.held.release()
            victim.cache = None
            preempted.append(victim)
            self._preemptions += 1
        # back to the head of the queue, oldest first, generated tokens kept (recompute)
        for r in preempted:
            self._waiting.appendleft(r)
        for r in reversed(preempted):
            events.append(PreemptedEvent(r.sample_id, r.seq_len, len(self._waiting)))
        for r in self._running:
            r.held.reserve(r.held.length + 1)
        return bool(preempted)

    def _admit(self) -> list[_Request]:
        admitted = []
        while self._waiting and len(self._running) < self.max_running:
            r = self._waiting[0]
            if self.pool.blocks_needed(r.seq_len) > self.pool.free_blocks:
                break  # FIFO: do not let short requests overtake (no starvation)
            self._waiting.popleft()
            r.cache = self.pool.new_sequence()
            r.cache.reserve(r.seq_len)
            r.admitted = self._admissions
            self._admissions += 1
            self._running.append(r)
            admitted.append(r)
        return admitted

    def _finish(self, r: _Request, reason: str, events: list[EngineEvent]) -> None:
        self._drop(r.sample_id)
        events.append(FinishedEvent(r.sample_id, list(r.gen), list(r.gen_lp), reason, r.prefix_len))

    def _find(self, sid: str) -> _Request | None:
        for r in self._running:
            if r.sample_id == sid:
                return r
        for r in self._waiting:
            if r.sample_id == sid:
                return r
        return None

    def _drop(self, sid: str) -> _Request | None:
        r = self._find(sid)
        if r is None:
            return None
        if r.cache is not None:
            r.cache.release()
            r.cache = None
            self._running.remove(r)
        else:
            self._waiting.remove(r)
        return r
