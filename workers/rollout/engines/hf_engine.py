"""The `hf` rollout engine: continuous batching over any `transformers` causal LM.

Correct rather than fast. Each running sample keeps its own K/V (one tensor pair per layer,
taken from the model's DynamicCache); a step left-pads them into one batched DynamicCache,
decodes one token for every running sample in a single forward (attention mask over the
padding, per-row position ids), and splits the grown cache back per sample. Newly admitted
samples are prefilled one by one (no padding). Scheduling is the `torch` engine's: admit
while `max_running` and the KV budget (`kv_capacity_tokens`, counted in tokens) allow,
preempt the most recently admitted sample by recompute when decoding runs out of room.

Sampling is `tiny_model.sample_tokens`: one uniform per (seed, position), so a sample's
tokens do not depend on the batch it shares (up to float rounding of the padded attention),
and a sample interrupted and continued from its tokens so far reproduces an uninterrupted
run. Log-probs are those of logits / temperature, as the trainer's TIS expects.

Models with sliding-window or otherwise non-standard caches are run with plain full-attention
cache layers; standard decoder models (Llama, Qwen2, Mistral without sliding window, ...) are
what this engine is for.
"""

from __future__ import annotations

import collections
import inspect
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from workers.extras import require
from workers.models.hf import eos_token_ids, load_model, load_tokenizer, max_positions
from workers.models.tiny_model import sample_tokens
from workers.rollout.engines.base import (
    Engine,
    EngineEvent,
    EngineStats,
    FinishedEvent,
    Partial,
    PreemptedEvent,
    TokensEvent,
)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of shape (1, heads, len, dim)


@dataclass(eq=False)  # identity: fields hold tensors
class _Request:
    sample_id: str
    context: list[int]  # prompt + prefix: what this stretch starts from
    prefix_len: int
    max_new: int
    seed: int
    gen: list[int] = field(default_factory=list)  # this stretch's tokens
    gen_lp: list[float] = field(default_factory=list)
    kv: KV | None = None  # K/V of all tokens but the last sampled one; None while waiting

    @property
    def seq_len(self) -> int:
        return len(self.context) + len(self.gen)

    @property
    def kv_len(self) -> int:
        return 0 if not self.kv else int(self.kv[0][0].shape[2])

    def tokens(self) -> list[int]:
        return self.context + self.gen


def _cache_layers(cache: Any) -> KV:
    """(keys, values) per layer of a DynamicCache (transformers 5: `.layers`; 4.x: lists)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _make_cache(kv: KV) -> Any:
    cls = require("transformers").DynamicCache
    try:
        return cls(ddp_cache_data=kv)
    except TypeError:  # transformers 4.x
        return cls.from_legacy_cache(tuple(kv))


class HFEngine(Engine):
    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        version: int = 0,
        kv_capacity_tokens: int = 8192,
        max_running: int = 256,
        temperature: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = 1,
    ):
        # None leaves torch's thread setting alone (a bigger model, an embedding process);
        # for tiny models intra-op threads only spin on a shared CPU
        if num_threads is not None and torch.device(device).type == "cpu":
            torch.set_num_threads(num_threads)
        if model is None:
            if model_path is None:
                raise ValueError("pass model_path or model")
            model = load_model(model_path, device, dtype)
        self.model = model.eval()
        if tokenizer is None and model_path is not None:
            tokenizer = load_tokenizer(model_path)
        self.eos = eos_token_ids(self.model, tokenizer)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.max_seq = max_positions(self.model.config)
        self.device = next(self.model.parameters()).device
        # transformers 5 renamed `past_key_values` (argument and output) to `cache`
        params = inspect.signature(self.model.forward).parameters
        self._cache_name = "cache" if "cache" in params else "past_key_values"
        self.kv_capacity = kv_capacity_tokens
        self.max_running = max_running
        self.temperature = temperature
        self._version = version
        self._running: list[_Request] = []  # admission order
        self._waiting: collections.deque[_Request] = collections.deque()
        self._finished_early: list[FinishedEvent] = []
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
        if not all(0 <= t < self.vocab_size for t in context):
            raise ValueError("token id out of vocabulary")
        if (self.max_seq is not None and len(context) >= self.max_seq) or max_new_tokens <= 0:
            self._finished_early.append(FinishedEvent(sample_id, [], [], "length", len(prefix_tokens)))
            return
        if len(context) + 1 > self.kv_capacity:
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
        with torch.no_grad():
            rows = [self._decode(decoding)] if decoding else []
            rows += [self._prefill(r) for r in admitted]
            logits = torch.cat(rows)
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

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        # by state-dict name, as the trainer's model of the same folder pushes them; K/V
        # already cached stay as computed by the old weights, as in vLLM
        self.model.load_state_dict(dict(state_dict), strict=True)
        self._version = int(version)

    def stats(self) -> EngineStats:
        busy = sum(d for d, _ in self._recent)
        return EngineStats(
            version=self._version,
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens=self._held(),
            kv_capacity=self.kv_capacity,
            running_tokens={r.sample_id: r.seq_len for r in self._running},
            tokens_per_s=sum(n for _, n in self._recent) / busy if busy > 0 else 0.0,
            preemptions=self._preemptions,
        )

    # ---- model -----------------------------------------------------------------------
    def _prefill(self, r: _Request) -> torch.Tensor:
        """Run the sample's tokens so far; keep their K/V; the next-token logits (1, V)."""
        ids = torch.tensor([r.tokens()], dtype=torch.long, device=self.device)
        out = self._forward(input_ids=ids, cache=_make_cache([]))
        r.kv = [(k.clone(), v.clone()) for k, v in _cache_layers(getattr(out, self._cache_name))]
        return out.logits[:, -1].float()

    def _decode(self, batch: list[_Request]) -> torch.Tensor:
        """One token for each sample: their caches left-padded into one (B, V) forward."""
        lens = [r.kv_len for r in batch]
        width = max(lens)
        kv: KV = []
        for layer in range(len(batch[0].kv or ())):
            ks, vs = [], []
            for r, n in zip(batch, lens):
                k, v = (r.kv or [])[layer]
                ks.append(F.pad(k, (0, 0, width - n, 0)))
                vs.append(F.pad(v, (0, 0, width - n, 0)))
            kv.append((torch.cat(ks), torch.cat(vs)))
        mask = torch.zeros(len(batch), width + 1, dtype=torch.long, device=self.device)
        for i, n in enumerate(lens):
            mask[i, width - n :] = 1
        out = self._forward(
            input_ids=torch.tensor([[r.gen[-1]] for r in batch], dtype=torch.long, device=self.device),
            attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lens], dtype=torch.long, device=self.device),
            cache=_make_cache(kv),
        )
        grown = _cache_layers(getattr(out, self._cache_name))
        for i, (r, n) in enumerate(zip(batch, lens)):
            # clones: a view would keep the whole padded batch tensor alive
            r.kv = [(k[i : i + 1, :, width - n :].clone(), v[i : i + 1, :, width - n :].clone()) for k, v in grown]
        return out.logits[:, -1].float()

    def _forward(self, cache: Any, **inputs: torch.Tensor) -> Any:
        return self.model(**inputs, **{self._cache_name: cache}, use_cache=True)

    # ---- scheduling --------------------------------------------------------------------
    def _held(self, requests: Iterable[_Request] | None = None) -> int:
        return sum(r.kv_len for r in (self._running if requests is None else requests))

    def _make_room_for_decode(self, events: list[EngineEvent]) -> bool:
        """Each running sample's next token needs one more KV slot: preempt the most recently
        admitted samples until that fits. Returns whether anything was preempted."""
        preempted: list[_Request] = []
        while self._running and self._held() + len(self._running) > self.kv_capacity:
            victim = self._running[-1]
            if len(self._running) == 1:  # alone and still no room: it can never finish
                self._finish(victim, "capacity", events)
                continue
            self._running.pop()
            victim.kv = None
            preempted.append(victim)
            self._preemptions += 1
        # back to the head of the queue, oldest first, generated tokens kept (recompute)
        for r in preempted:
            self._waiting.appendleft(r)
        for r in reversed(preempted):
            events.append(PreemptedEvent(r.sample_id, r.seq_len, len(self._waiting)))
        return bool(preempted)

    def _admit(self) -> list[_Request]:
        admitted = []
        held = self._held()
        while self._waiting and len(self._running) < self.max_running:
            r = self._waiting[0]
            if held + r.seq_len > self.kv_capacity:
                break  # FIFO: do not let short requests overtake (no starvation)
            self._waiting.popleft()
            held += r.seq_len
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
        if r in self._running:
            self._running.remove(r)
        else:
            self._waiting.remove(r)
        r.kv = None
        return r
