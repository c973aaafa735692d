"""The `hf` rollout engine: continuous batching over any `transformers` causal LM.

Correct rather than fast. Each running sample keeps its own K/V (one tensor pair per layer,
taken from the model's DynamicCache); a step left-pads them into one batched DynamicCache,
decodes one token for every running sample in a single forward (attention mask over the
padding, per-row position ids), and splits the grown cache back per sample. Newly admitted
samples are prefilled one by one (no padding). Scheduling is `batching.BatchingEngine`'s,
as for the `torch` engine: admit while `max_running` and the KV budget
(`kv_capacity_tokens`, counted in tokens) allow, preempt the most recently admitted sample
by recompute when decoding runs out of room.

Sampling is `tiny_model.sample_tokens`: one uniform per (seed, position), so a sample's
tokens do not depend on the batch it shares (up to float rounding of the padded attention),
and a sample interrupted and continued from its tokens so far reproduces an uninterrupted
run. Log-probs are those of logits / temperature, as the trainer's TIS expects.

Models with sliding-window or otherwise non-standard caches are run with plain full-attention
cache layers; standard decoder models (Llama, Qwen2, Mistral without sliding window, ...) are
what this engine is for.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F

from workers.extras import require
from workers.models.hf import eos_token_ids, load_model, load_tokenizer, max_positions
from workers.rollout.engines.batching import BatchingEngine, Request, limit_cpu_threads

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of shape (1, heads, len, dim)


def _kv_len(r: Request[KV]) -> int:
    return 0 if not r.cache else int(r.cache[0][0].shape[2])


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


class HFEngine(BatchingEngine[KV]):
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
        dtype: torch.dtype | str = torch.float32,
        num_threads: int | None = 1,
        max_len: int | None = None,
    ):
        """`dtype`: a torch dtype or its name ("bfloat16"); `max_len`: the longest sequence
        (prompt + response) served, at most the model's position limit."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
            assert isinstance(dtype, torch.dtype), dtype
        limit_cpu_threads(num_threads, device)
        if model is None:
            if model_path is None:
                raise ValueError("pass model_path or model")
            model = load_model(model_path, device, dtype)
        self.model = model.eval()
        if tokenizer is None and model_path is not None:
            tokenizer = load_tokenizer(model_path)
        self.device = next(self.model.parameters()).device
        # transformers 5 renamed `past_key_values` (argument and output) to `cache`
        params = inspect.signature(self.model.forward).parameters
        self._cache_name = "cache" if "cache" in params else "past_key_values"
        self.kv_capacity = kv_capacity_tokens
        limits = [n for n in (max_positions(self.model.config), max_len) if n is not None]
        super().__init__(
            version=version,
            max_running=max_running,
            temperature=temperature,
            vocab_size=int(self.model.get_input_embeddings().num_embeddings),
            max_seq=min(limits) if limits else None,
            eos=eos_token_ids(self.model, tokenizer),
        )

    # ---- model -----------------------------------------------------------------------
    def _logits(self, decoding: list[Request[KV]], admitted: list[Request[KV]]) -> torch.Tensor:
        with torch.no_grad():
            rows = [self._decode(decoding)] if decoding else []
            rows += [self._prefill(r) for r in admitted]
            return torch.cat(rows)

    def _prefill(self, r: Request[KV]) -> torch.Tensor:
        """Run the sample's tokens so far; keep their K/V; the next-token logits (1, V)."""
        ids = torch.tensor([r.tokens()], dtype=torch.long, device=self.device)
        out = self._call(input_ids=ids, cache=_make_cache([]))
        r.cache = [(k.clone(), v.clone()) for k, v in _cache_layers(getattr(out, self._cache_name))]
        return out.logits[:, -1].float()

    def _decode(self, batch: list[Request[KV]]) -> torch.Tensor:
        """One token for each sample: their caches left-padded into one (B, V) forward."""
        lens = [_kv_len(r) for r in batch]
        width = max(lens)
        kv: KV = []
        for layer in range(len(batch[0].cache or ())):
            ks, vs = [], []
            for r, n in zip(batch, lens):
                k, v = (r.cache or [])[layer]
                ks.append(F.pad(k, (0, 0, width - n, 0)))
                vs.append(F.pad(v, (0, 0, width - n, 0)))
            kv.append((torch.cat(ks), torch.cat(vs)))
        mask = torch.zeros(len(batch), width + 1, dtype=torch.long, device=self.device)
        for i, n in enumerate(lens):
            mask[i, width - n :] = 1
        out = self._call(
            input_ids=torch.tensor([[r.gen[-1]] for r in batch], dtype=torch.long, device=self.device),
            attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lens], dtype=torch.long, device=self.device),
            cache=_make_cache(kv),
        )
        grown = _cache_layers(getattr(out, self._cache_name))
        for i, (r, n) in enumerate(zip(batch, lens)):
            # clones: a view would keep the whole padded batch tensor alive
            r.cache = [(k[i : i + 1, :, width - n :].clone(), v[i : i + 1, :, width - n :].clone()) for k, v in grown]
        return out.logits[:, -1].float()

    def _call(self, cache: Any, **inputs: torch.Tensor) -> Any:
        return self.model(**inputs, **{self._cache_name: cache}, use_cache=True)

    # ---- KV cache: a token budget over per-sample tensors -------------------------------
    def _held(self) -> int:
        # a sample admitted this step holds no K/V until its prefill: count what it will hold
        return sum(_kv_len(r) if r.cache is not None else r.seq_len for r in self._running)

    def _kv_fits_alone(self, n_tokens: int) -> bool:
        return n_tokens <= self.kv_capacity

    def _kv_fits_decode(self) -> bool:
        return self._held() + len(self._running) <= self.kv_capacity

    def _kv_admit(self, r: Request[KV]) -> bool:
        return self._held() + r.seq_len <= self.kv_capacity

    def _kv_release(self, r: Request[KV]) -> None:
        r.cache = None

    def _kv_usage(self) -> tuple[int, int]:
        return self._held(), self.kv_capacity
