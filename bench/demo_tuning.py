"""The demo's learning problem in one process, for tuning (not the demo itself): the same tiny
model class, the same GRPO update (`grpo_update`), the same task and verifier, but synchronous
rollouts sampled in a plain batched loop. A setting takes seconds to a minute on one core.

    python bench/demo_tuning.py --steps 150 --ppo-epochs 4 --lr 2e-3

Prints reward and accuracy per tenth of the run and a last line
`tuning ... accuracy=A reward=R` (means over the last tenth of the steps, as the demo).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from workers.models.tiny_model import TinyConfig, TinyTransformer
from workers.tasks.repeat import RepeatTask
from workers.tasks.verifiers import repeat_verifier
from workers.tasks.warm_start import warm_start
from workers.trainer.grpo import GRPOConfig, grpo_update


def _step(model: TinyTransformer, tok: torch.Tensor, pos: int, cache: list) -> torch.Tensor:
    """Logits after appending `tok` (B, L) at positions pos.. (a plain K/V cache: only the
    new tokens are computed, the tiny model's own cached path is per-row and slow)."""
    cfg = model.cfg
    B, L = tok.shape
    H, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    h = model.tok_emb[tok] + model.pos_emb[pos : pos + L]
    for li, blk in enumerate(model.layers):
        q, k, v = blk.qkv.full(blk.ln1(h)).split(cfg.d_model, dim=-1)
        q, k, v = (t.view(B, L, H, dh).transpose(1, 2) for t in (q, k, v))
        if len(cache) > li:
            k, v = torch.cat([cache[li][0], k], dim=2), torch.cat([cache[li][1], v], dim=2)
            cache[li] = (k, v)
        else:
            cache.append((k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=L > 1)
        h = h + blk.proj.full(a.transpose(1, 2).reshape(B, L, cfg.d_model))
        h = h + blk.fc2.full(F.gelu(blk.fc1.full(blk.ln2(h))))
    return model.lm_head.full(model.ln_f(h))[:, -1]


@torch.no_grad()
def rollout(model: TinyTransformer, prompts: list[list[int]], max_new: int, gen: torch.Generator):
    """Sample each prompt's response at temperature 1 (all prompts the same length)."""
    x = torch.tensor(prompts)
    cache: list = []
    logits = _step(model, x, 0, cache)
    pos = x.shape[1]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out_t, out_lp = [], []
    for _ in range(max_new):
        logp = torch.log_softmax(logits.float(), dim=-1)
        t = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        out_t.append(t)
        out_lp.append(logp.gather(1, t.unsqueeze(1)).squeeze(1))
        done |= t == model.cfg.eos_token_id
        if bool(done.all()):
            break
        logits = _step(model, t.unsqueeze(1), pos, cache)
        pos += 1
    T, LP = torch.stack(out_t, 1).tolist(), torch.stack(out_lp, 1).tolist()
    toks, lps = [], []
    for row, lrow in zip(T, LP):
        n = row.index(0) + 1 if 0 in row else len(row)
        toks.append(row[:n])
        lps.append(lrow[:n])
    return toks, lps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-std", type=float, default=0.1)
    ap.add_argument("--lr-end", type=float, default=1.0, help="lr multiplier reached linearly at the last step")
    ap.add_argument("--pos-std", type=float, default=0.1)
    ap.add_argument("--clip-high", type=float, default=0.28)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=0, help="supervised warm start on format-only demos")
    ap.add_argument("--sft-noise", type=int, default=-1, help="-1: demo length independent of COUNT; k: COUNT +- k")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    task = RepeatTask()
    cfg = TinyConfig(
        vocab_size=task.vocab_size,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq=8 + task.max_response,
        head_std=args.head_std,
        pos_std=args.pos_std,
    )
    model = TinyTransformer(cfg, seed=args.seed)
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    grpo = GRPOConfig(clip_high=args.clip_high)
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    if args.sft_steps:
        warm_start(model, task, args.sft_steps, args.seed, None if args.sft_noise < 0 else args.sft_noise)
        model.requires_grad_(True)
    best = 1.2
    hist: list[tuple[float, float]] = []
    diag: list[tuple[int, int, bool]] = []
    t0 = time.monotonic()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * (1 + (args.lr_end - 1) * step / max(1, args.steps - 1))
        batch = [task.prompt(rng) for _ in range(args.batch_size)]
        prompts = [p for p, _ in batch for _ in range(args.group_size)]
        metas = [m for _, m in batch for _ in range(args.group_size)]
        toks, lps = rollout(model, prompts, task.max_response, gen)
        rewards = [
            repeat_verifier(t, "eos" if t and t[-1] == 0 else "length", m, lambda x: "") for t, m in zip(toks, metas)
        ]
        hist.append((sum(r >= best - 1e-6 for r in rewards) / len(rewards), sum(rewards) / len(rewards)))
        diag.extend(
            (m["count"], len(t) - 1 if t and t[-1] == 0 else 99, all(x == m["symbol"] for x in t[:-1]))
            for t, m in zip(toks, metas)
        )
        if (step + 1) % max(1, args.steps // 10) == 0:
            small = [d for d in diag if d[0] <= 10]
            big = [d for d in diag if d[0] > 10]
            print(
                f"  symbol ok {sum(d[2] for d in diag) / len(diag):.2f}, exact len (count<=10) "
                f"{sum(d[1] == d[0] for d in small) / max(1, len(small)):.2f}, |len err| (count<=10) "
                f"{sum(min(abs(d[1] - d[0]), 48) for d in small) / max(1, len(small)):.1f}, exact len (count>10) "
                f"{sum(d[1] == d[0] for d in big) / max(1, len(big)):.2f} |err| {sum(min(abs(d[1] - d[0]), 48) for d in big) / max(1, len(big)):.1f}"
            )
            diag.clear()
            w = hist[-max(1, args.steps // 10) :]
            print(
                f"step {step + 1}: accuracy {sum(a for a, _ in w) / len(w):.3f} reward {sum(r for _, r in w) / len(w):+.3f}",
                flush=True,
            )
        groups = [i // args.group_size for i in range(len(prompts))]
        # DAPO's filter: groups whose rewards are all equal carry no signal
        keep = [
            i
            for i in range(len(prompts))
            if len({rewards[j] for j in range(len(prompts)) if groups[j] == groups[i]}) > 1
        ]
        if not keep:
            continue
        grpo_update(
            model,
            opt,
            [prompts[i] + toks[i] for i in keep],
            [len(prompts[i]) for i in keep],
            [lps[i] for i in keep],
            [groups[i] for i in keep],
            [rewards[i] for i in keep],
            grpo,
            epochs=args.ppo_epochs,
            minibatches=args.minibatches,
        )
        model.requires_grad_(True)
    tenth = max(1, args.steps // 10)
    for k in range(0, args.steps, tenth):
        w = hist[k : k + tenth]
        print(
            f"steps {k:4d}-{k + len(w) - 1:4d}: accuracy {sum(a for a, _ in w) / len(w):.3f} reward {sum(r for _, r in w) / len(w):+.3f}"
        )
    w = hist[-tenth:]
    acc, rew = sum(a for a, _ in w) / len(w), sum(r for _, r in w) / len(w)
    print(f"tuning {' '.join(sys.argv[1:])} accuracy={acc:.3f} reward={rew:.3f} seconds={time.monotonic() - t0:.0f}")


if __name__ == "__main__":
    main()
