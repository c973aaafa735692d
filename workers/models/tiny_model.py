"""A small decoder-only transformer with an explicit, paged KV cache.

Built for the `torch` rollout engine, where one property matters more than speed: the
token sampled at position t of a sample depends only on (weights, sample seed, tokens so
far) -- never on which other sequences share the batch, and never on whether earlier
tokens went through prefill or decode. Then a sample interrupted on one engine and
continued from its prefix on another (same weights) reproduces the uninterrupted run
bit for bit, tokens and log-probs alike.

How that is achieved:
  * every token row goes through shape-identical ops whatever the batch: linear layers
    are a batched 1xK @ KxN product (`torch.bmm` with the weight broadcast), because a
    plain (M,K)@(K,N) matmul picks different kernels -- hence different rounding -- for
    different M (M=1 is a GEMV);
  * attention runs per token row over exactly the keys 0..t of its own sequence, so a
    prefill row and the equivalent decode row compute the same thing;
  * sampling draws its uniform number from a hash of (seed, position), and picks the
    token by inverse CDF, so the RNG state never depends on the batch.
On CPU this makes the guarantee hold (tests check it bitwise). On CUDA, cuBLAS may pick
algorithms by batch count, so cross-batch bit equality there is best effort; on an H200 it held
(bench/gpu_check.py's `torch_engine` case: 8 of 8 samples token-identical alone and batched
under preemption, an interrupted sample resumed identically).

`forward()` is the ordinary full-sequence causal path (fast matmuls) for scoring/training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq: int = 512
    eos_token_id: int = 0
    mlp_ratio: int = 4
    # lm_head init std times sqrt(d_model). 2.0 makes next-token distributions peaked, so
    # tests see structured sampling; RL from scratch wants ~0.1 (near-uniform: it explores)
    head_std: float = 2.0
    # position-embedding init std. 0.1 (the default) leaves positions nearly alike next to the
    # token embeddings (0.5); a task that must stop after COUNT tokens learns faster from ~0.5
    pos_std: float = 0.1

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError("eos_token_id out of vocabulary")

    def to_dict(self) -> dict:
        return asdict(self)


class KVCacheFull(RuntimeError):
    """Raised when a sequence needs a KV block and the pool has none left."""


class KVPool:
    """Fixed-size paged K/V storage shared by all sequences of one engine.

    Capacity is real memory: `capacity_tokens` slots are allocated once, handed out in
    blocks of `block_size` tokens (as in vLLM), and a sequence that cannot get a block
    fails. `tokens_held` counts slots actually written by live sequences.
    """

    def __init__(
        self,
        cfg: TinyConfig,
        capacity_tokens: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if capacity_tokens < block_size or block_size < 1:
            raise ValueError("capacity_tokens must be >= block_size >= 1")
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.device = torch.device(device)
        shape = (cfg.n_layers, self.num_blocks * block_size, cfg.n_heads, cfg.d_model // cfg.n_heads)
        self.k = torch.zeros(shape, device=self.device, dtype=dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=dtype)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.tokens_held = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def new_sequence(self) -> SeqCache:
        return SeqCache(self)


class SeqCache:
    """One sequence's view of the pool: its block table and how many tokens it holds."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0  # tokens whose K/V are stored (positions 0..length-1)
        # slot of each position, kept on device so attention can gather without host work
        self.slot_idx = torch.empty(pool.cfg.max_seq, dtype=torch.long, device=pool.device)

    def extra_blocks(self, new_length: int) -> int:
        return max(0, self.pool.blocks_needed(new_length) - len(self.blocks))

    def reserve(self, new_length: int) -> None:
        """Make room for positions up to new_length-1, or raise KVCacheFull (no change)."""
        extra = self.extra_blocks(new_length)
        if extra > len(self.pool._free):
            raise KVCacheFull(f"need {extra} blocks, {len(self.pool._free)} free")
        self.blocks.extend(self.pool._free.pop() for _ in range(extra))

    def _slots(self, start: int, end: int) -> list[int]:
        bs = self.pool.block_size
        return [self.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def release(self) -> None:
        self.pool._free.extend(reversed(self.blocks))
        self.pool.tokens_held -= self.length
        self.blocks, self.length = [], 0


class _Linear(nn.Module):
    """y = x @ W + b with W stored (in, out); `forward` is the batch-invariant row path."""

    def __init__(self, d_in: int, d_out: int, gen: torch.Generator, std: float | None = None):
        super().__init__()
        std = std if std is not None else 1.0 / math.sqrt(d_in)
        self.weight = nn.Parameter(torch.randn(d_in, d_out, generator=gen) * std)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (M, in)
        w = self.weight.unsqueeze(0).expand(x.shape[0], -1, -1)
        return torch.bmm(x.unsqueeze(1), w).squeeze(1) + self.bias

    def full(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig, gen: torch.Generator):
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.qkv = _Linear(d, 3 * d, gen)
        self.proj = _Linear(d, d, gen, std=0.5 / math.sqrt(d))
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = _Linear(d, cfg.mlp_ratio * d, gen)
        self.fc2 = _Linear(cfg.mlp_ratio * d, d, gen, std=0.5 / math.sqrt(cfg.mlp_ratio * d))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TinyConfig = TinyConfig(), seed: int = 0):
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)  # same seed -> same weights anywhere
        d = cfg.d_model
        self.tok_emb = nn.Parameter(torch.randn(cfg.vocab_size, d, generator=gen) * 0.5)
        self.pos_emb = nn.Parameter(torch.randn(cfg.max_seq, d, generator=gen) * cfg.pos_std)
        self.blocks = nn.ModuleList(_Block(cfg, gen) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = _Linear(d, cfg.vocab_size, gen, std=cfg.head_std / math.sqrt(d))
        self.requires_grad_(False)  # rollout use; a trainer re-enables grads explicitly

    @property
    def device(self) -> torch.device:
        return self.tok_emb.device

    @property
    def layers(self) -> list[_Block]:
        # nn.ModuleList is not generic: iterating it types each block as a plain Module.
        return cast(list[_Block], list(self.blocks))

    # ---- full-sequence path (scoring / training) ---------------------------------------
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), causal. Matches the cached path to rounding."""
        cfg = self.cfg
        B, T = tokens.shape
        H, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
        h = self.tok_emb[tokens] + self.pos_emb[:T]
        for blk in self.layers:
            q, k, v = blk.qkv.full(blk.ln1(h)).split(cfg.d_model, dim=-1)
            q, k, v = (t.view(B, T, H, dh).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + blk.proj.full(a.transpose(1, 2).reshape(B, T, cfg.d_model))
            h = h + blk.fc2.full(F.gelu(blk.fc1.full(blk.ln2(h))))
        return self.lm_head.full(self.ln_f(h))

    # ---- cached path ----------------------------------------------------------------
    def prefill(self, cache: SeqCache, tokens: Sequence[int]) -> torch.Tensor:
        """Append `tokens` to the sequence's cache; return the logits (V,) after the last."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        start = cache.length
        return self.forward_rows([cache] * len(tokens), list(range(start, start + len(tokens))), list(tokens))[-1]

    def decode(self, caches: Sequence[SeqCache], tokens: Sequence[int]) -> torch.Tensor:
        """One new token per sequence (sequences of any lengths); returns logits (B, V)."""
        return self.forward_rows(list(caches), [c.length for c in caches], list(tokens))

    @torch.no_grad()
    def forward_rows(self, caches: list[SeqCache], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """Each row is one token at `positions[i]` of `caches[i]`; rows of one sequence must
        be consecutive and ascending. Writes their K/V, attends each row over 0..pos."""
        cfg = self.cfg
        H, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
        if max(positions) >= cfg.max_seq:
            raise ValueError(f"position {max(positions)} >= max_seq {cfg.max_seq}")
        # reserve blocks for every sequence first so a KVCacheFull leaves nothing half-done
        ends: dict[int, tuple[SeqCache, int]] = {}
        for c, p in zip(caches, positions):
            ends[id(c)] = (c, max(p + 1, ends.get(id(c), (c, 0))[1]))
        need = sum(c.extra_blocks(e) for c, e in ends.values())
        if need > caches[0].pool.free_blocks:
            raise KVCacheFull(f"need {need} blocks, {caches[0].pool.free_blocks} free")
        for c, e in ends.values():
            c.reserve(e)
            c.slot_idx[c.length : e] = torch.tensor(c._slots(c.length, e), dtype=torch.long)
        pool = caches[0].pool
        bs = pool.block_size
        dev = self.device
        slot_t = torch.tensor(
            [c.blocks[p // bs] * bs + p % bs for c, p in zip(caches, positions)], dtype=torch.long, device=dev
        )
        h = self.tok_emb[torch.tensor(tokens, device=dev)] + self.pos_emb[torch.tensor(positions, device=dev)]
        scale = 1.0 / math.sqrt(dh)
        for li, blk in enumerate(self.layers):
            q, k, v = blk.qkv(blk.ln1(h)).split(cfg.d_model, dim=-1)
            pool.k[li].index_copy_(0, slot_t, k.reshape(-1, H, dh))
            pool.v[li].index_copy_(0, slot_t, v.reshape(-1, H, dh))
            q = (q * scale).view(-1, H, 1, dh)
            outs = []
            for i, (c, p) in enumerate(zip(caches, positions)):
                idx = c.slot_idx[: p + 1]
                kk = pool.k[li].index_select(0, idx).transpose(0, 1)  # (H, p+1, dh)
                vv = pool.v[li].index_select(0, idx).transpose(0, 1)
                att = torch.softmax(torch.bmm(q[i], kk.transpose(1, 2)), dim=-1)
                outs.append(torch.bmm(att, vv).reshape(cfg.d_model))
            h = h + blk.proj(torch.stack(outs))
            h = h + blk.fc2(F.gelu(blk.fc1(blk.ln2(h))))
        for c, e in ends.values():
            pool.tokens_held += e - c.length
            c.length = e
        return self.lm_head(self.ln_f(h))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * 2.0**-53


def sample_tokens(
    logits: torch.Tensor, seeds: Sequence[int], positions: Sequence[int], temperature: float = 1.0
) -> tuple[list[int], list[float]]:
    """Sample one token per row of logits (B, V) for the sequence positions given.

    Log-probs are those of the sampling distribution (logits / temperature), which is what
    importance-sampling corrections need. temperature == 0 is greedy; its log-prob is
    then taken at temperature 1.
    """
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    if temperature == 0:
        tok = logp.argmax(dim=-1)
    else:
        cdf = logp.double().exp().cumsum(dim=-1)
        u = torch.tensor([uniform(s, p) for s, p in zip(seeds, positions)], dtype=torch.float64, device=logits.device)
        target = (u * cdf[:, -1]).unsqueeze(1)  # scale: cdf[-1] may be 1 +- rounding
        tok = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[-1] - 1)
        tok = tok.squeeze(1)
    lp = logp.gather(1, tok.unsqueeze(1)).squeeze(1)
    return tok.tolist(), lp.tolist()


def generate(
    model: TinyTransformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
    capacity_tokens: int | None = None,
) -> tuple[list[int], list[float]]:
    """Reference single-sequence generation (prefill + decode loop); used by tests/tools."""
    cfg = model.cfg
    pool = KVPool(cfg, capacity_tokens or cfg.max_seq, block_size=16, device=model.device, dtype=model.tok_emb.dtype)
    cache = pool.new_sequence()
    seq = list(prompt)
    out: list[int] = []
    lps: list[float] = []
    logits = model.prefill(cache, seq).unsqueeze(0)
    while True:
        (t,), (lp,) = sample_tokens(logits, [seed], [len(seq)], temperature)
        out.append(t)
        lps.append(lp)
        seq.append(t)
        if t == cfg.eos_token_id or len(out) >= max_new_tokens or len(seq) >= cfg.max_seq:
            return out, lps
        logits = model.decode([cache], [t])
