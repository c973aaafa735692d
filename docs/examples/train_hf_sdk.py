"""Train a Hugging Face causal LM through StaleFlow with a plain PyTorch loop (the trainer SDK).

StaleFlow (API, parameter server, rollout and reward workers, coordinator) produces the
samples; this script is the whole trainer: a GRPO loss written out below, an AdamW step, and
three SDK calls (`start`, `next_batch`, `publish`). Replace the loss or the loop with your
own trainer (FSDP, TRL, ...): only those three calls touch StaleFlow.

    python docs/examples/train_hf_sdk.py --run my-run --model ./my-model --ps 127.0.0.1:29600 --steps 100

A run past version 0 (this script restarted) trains on from its published weights: pass
--resume to load them from the parameter server (the optimizer state starts afresh); without
it `start` refuses the folder's weights rather than train on from them as if they were the
run's.

The token (role `trainer`) comes from --token or STALEFLOW_TOKEN; --api from STALEFLOW_API_URL.
The rollout workers must run the same folder: `staleflow rollout-worker --engine hf --model`.
"""

from __future__ import annotations

import argparse
import os

import torch

from workers.models.hf import load_model
from workers.sdk import Batch, TrainerClient


def grpo_loss(model: torch.nn.Module, batch: Batch, clip: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO with PPO clipping against the generating model's log-probs (off-policy by up to
    eta versions: the importance ratio corrects for the staleness, the clip bounds it)."""
    # advantage: each sample's reward against its group's mean, in units of the group's spread
    adv = torch.zeros_like(batch.rewards)
    for g in batch.group_ids.unique():
        rows = batch.group_ids == g
        r = batch.rewards[rows]
        adv[rows] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    # position t predicts token t + 1: shift the targets, the mask and the old log-probs alike
    # the engines' log-probs are of softmax(logits / T) at the run's sampling temperature
    logp = torch.log_softmax(logits / batch.temperature, dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask, old = batch.response_mask[:, 1:], batch.logprobs[:, 1:]
    ratio = torch.exp((logp - old) * mask)
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1)  # token-level mean (DAPO)
    with torch.no_grad():
        drift = ((logp - old).abs() * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"logprob_drift": float(drift)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the run's name or id")
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--api", default=os.environ.get("STALEFLOW_API_URL") or None)
    ap.add_argument("--token", default=os.environ.get("STALEFLOW_TOKEN") or None)
    ap.add_argument("--ps", default=None, help="HOST:PORT of `staleflow ps` (where rollout workers pull weights)")
    ap.add_argument("--resume", action="store_true", help="a run past version 0: load its published weights")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a batch")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = load_model(args.model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with TrainerClient(args.api, args.token, args.run, ps=args.ps, pad_id=pad) as sf:
        if args.resume and sf.version > 0:
            model.load_state_dict(sf.published_weights())
        sf.start(model.state_dict())  # version 0 for the rollout workers; refuses fresh weights past it
        for _ in range(args.steps):
            batch = sf.next_batch(timeout=args.timeout)
            if batch is None:
                raise SystemExit(f"no batch within {args.timeout:g}s (are rollout and reward workers running?)")
            loss, stats = grpo_loss(model, batch)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            version = sf.publish(batch.version, model.state_dict())
            print(
                f"v{batch.version}->v{version}: {len(batch)} samples reward {batch.rewards.mean():.3f} "
                f"loss {loss.item():+.4f} staleness {batch.staleness.tolist()} drift {stats['logprob_drift']:.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
