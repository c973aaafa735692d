"""The `torch` rollout engine: continuous batching over `TinyTransformer` with a paged KV
cache of fixed capacity. The scheduling (admit while room exists, preempt the most recently
admitted sample by recompute when it runs out) is `batching.BatchingEngine`'s; this module
is the model's forward and the paged KV accounting.

Runs on CPU; pass device="cuda" to run on a GPU. See tiny_model.py for why a sample's
tokens do not depend on the batch it shares, which is what makes interrupt-and-continue
(on this or another instance with the same weights) reproduce an uninterrupted run.
"""

from __future__ import annotations

import torch

from workers.models.tiny_model import KVPool, SeqCache, TinyConfig, TinyTransformer
from workers.rollout.engines.batching import BatchingEngine, Request, limit_cpu_threads


class TorchEngine(BatchingEngine[SeqCache]):
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
        limit_cpu_threads(num_threads, device)
        self.model = (model or TinyTransformer(config, seed=model_seed)).to(device=device, dtype=dtype)
        self.cfg = self.model.cfg
        self.pool = KVPool(self.cfg, kv_capacity_tokens, block_size, device=device, dtype=dtype)
        super().__init__(
            version=version,
            max_running=max_running,
            temperature=temperature,
            vocab_size=self.cfg.vocab_size,
            max_seq=self.cfg.max_seq,
            eos=frozenset({self.cfg.eos_token_id}),
        )

    # ---- model -----------------------------------------------------------------------
    def _logits(self, decoding: list[Request[SeqCache]], admitted: list[Request[SeqCache]]) -> torch.Tensor:
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
        return self.model.forward_rows(caches, positions, tokens)[last_rows]

    # ---- KV cache: fixed-size blocks of the pool ----------------------------------------
    def _kv_fits_alone(self, n_tokens: int) -> bool:
        return self.pool.blocks_needed(n_tokens) <= self.pool.num_blocks

    def _kv_fits_decode(self) -> bool:
        need = sum(r.held.extra_blocks(r.held.length + 1) for r in self._running)
        return need <= self.pool.free_blocks

    def _kv_reserve_decode(self) -> None:
        for r in self._running:
            r.held.reserve(r.held.length + 1)

    def _kv_admit(self, r: Request[SeqCache]) -> bool:
        if self.pool.blocks_needed(r.seq_len) > self.pool.free_blocks:
            return False
        r.cache = self.pool.new_sequence()
        r.cache.reserve(r.seq_len)
        return True

    def _kv_release(self, r: Request[SeqCache]) -> None:
        if r.cache is not None:
            r.cache.release()
            r.cache = None

    def _kv_usage(self) -> tuple[int, int]:
        return self.pool.tokens_held, self.pool.capacity_tokens
