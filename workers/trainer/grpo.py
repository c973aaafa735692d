"""The policy loss of the reference runs (docs/policies.md): DAPO on a GRPO advantage, pure torch.

* Advantage: (reward - group mean) / (group std + eps), per prompt group; no KL term.
* Ratio r = π_θ / π_old per response token, PPO-clipped with clip-higher:
  [1 - ε_low, 1 + ε_high] (0.2 / 0.28 by default), so unlikely tokens may grow faster
  than likely ones shrink (DAPO's remedy against entropy collapse).
* Truncated importance sampling (TIS): the rollout engine sampled from π_rollout, which is
  not exactly π_old (another numeric stack, and under StaleFlow possibly an older version
  for part of the trajectory). Each token's loss is weighted by
  min(π_old / π_rollout, cap), detached, cap 2 by default.
* Token-mean aggregation: every response token of the batch weighs the same, so long
  responses are not diluted (DAPO), which is why callers that split a batch into micro
  batches pass the token count of the whole batch.
* The overlong penalty is a reward shaping and lives in the verifier (tasks/verifiers.py).

`grpo_update` trains on one batch: with one optimizer step π_old is the model before it,
`old_logp = logp.detach()` of the same forward pass (ratio 1 in value, gradient of the
clipped objective intact); with several (PPO epochs x minibatches) π_old's log-probs are
computed once up front and the clip keeps the reuse stable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GRPOConfig:
    clip_low: float = 0.2  # ε_low
    clip_high: float = 0.28  # ε_high (clip-higher)
    tis_cap: float | None = 2.0  # None: no importance-sampling correction
    adv_eps: float = 1e-6
    temperature: float = 1.0  # the rollout's sampling temperature (log-probs are of logits / T)

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("need 0 <= clip_low < 1 and clip_high >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError("tis_cap must be > 0 (or None to disable TIS)")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_g) / (std_g + eps) per sample; `group_index` (same shape, ints 0..G-1) names
    each sample's group. std is the unbiased one (as torch.std). A group of one sample has no
    baseline: it keeps its raw reward (mean 0, std 1), as in veRL's GRPO."""
    rewards = rewards.double()
    g = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(g, dtype=torch.float64).index_add_(0, group_index, rewards) / count
    dev2 = (rewards - mean[group_index]) ** 2
    var = torch.zeros(g, dtype=torch.float64).index_add_(0, group_index, dev2) / (count - 1).clamp(min=1)
    single = count[group_index] < 2
    mean_s = torch.where(single, torch.zeros_like(rewards), mean[group_index])
    std_s = torch.where(single, torch.ones_like(rewards), var.sqrt()[group_index])
    return ((rewards - mean_s) / (std_s + eps)).float()


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token under logits / T, and the distribution's entropy
    (detached): logits (B, T, V), targets (B, T) -> two (B, T) tensors."""
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig = GRPOConfig(),
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped, TIS-weighted, token-mean policy-gradient loss.

    Shapes (B, T) except `advantages`, which is (B,) per sequence or (B, T) per token.
    `mask` is 1 on the response tokens that count. `num_tokens` is the denominator of the
    token mean (default: this call's mask sum); pass the whole batch's count when summing
    micro-batch losses so the gradient equals the full batch's.
    Returns (loss, sums) where `sums` holds per-token sums for metrics (divide by tokens).
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logp)
    old_logp = old_logp.detach()
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if cfg.tis_cap is not None:
        with torch.no_grad():
            tis = torch.exp(old_logp - rollout_logp.to(logp.dtype)).clamp(max=cfg.tis_cap)
        per_token = per_token * tis
    else:
        tis = torch.ones_like(logp)
    denom = float(num_tokens) if num_tokens is not None else float(mask.sum().clamp(min=1))
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        # the clipped branch is the active one (zero gradient) on these tokens
        was_clipped = (clipped < unclipped).to(logp.dtype)
        sums = {
            "tokens": float(mask.sum()),
            "clipped": float((was_clipped * mask).sum()),
            "tis": float((tis * mask).sum()),
            "tis_capped": float(((tis >= (cfg.tis_cap or float("inf"))).to(logp.dtype) * mask).sum()),
            "ratio": float((ratio * mask).sum()),
            # log π_old - log π_rollout: the train/rollout mismatch that TIS corrects
            "mismatch": float(((old_logp - rollout_logp.to(logp.dtype)) * mask).sum()),
        }
    return loss, sums


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Per-token means from the (possibly micro-batch accumulated) sums of policy_loss."""
    n = max(sums.get("tokens", 0.0), 1.0)
    out = {
        "clip_frac": sums.get("clipped", 0.0) / n,
        "tis_mean": sums.get("tis", 0.0) / n,
        "tis_capped_frac": sums.get("tis_capped", 0.0) / n,
        "ratio_mean": sums.get("ratio", 0.0) / n,
        "mismatch_mean": sums.get("mismatch", 0.0) / n,
    }
    if "entropy" in sums:
        out["entropy"] = sums["entropy"] / n
    return out


def _pad(
    seqs: list[list[int]],
    starts: list[int],
    rollout: list[list[float]],
    idx: list[int],
    loss_masks: list[list[int]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Inputs, targets, response mask and rollout log-probs of the rows `idx`, right-padded
    (causal attention never looks ahead, so padding needs no attention mask). The response
    mask is 1 on generated tokens only: `loss_masks[i]` (per response token, 0 on an
    environment's observations) when given, else all of the response."""
    width = max(len(seqs[i]) for i in idx) - 1  # inputs are seq[:-1], targets seq[1:]
    inp = torch.zeros(len(idx), width, dtype=torch.long)
    tgt = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros(len(idx), width)
    rlp = torch.zeros(len(idx), width)
    for row, i in enumerate(idx):
        toks, p, n = seqs[i], starts[i], len(rollout[i])
        inp[row, : len(toks) - 1] = torch.tensor(toks[:-1])
        tgt[row, : len(toks) - 1] = torch.tensor(toks[1:])
        # response token t sits at sequence position p + t, predicted from p + t - 1
        mask[row, p - 1 : p - 1 + n] = 1.0 if loss_masks is None else torch.tensor(loss_masks[i], dtype=mask.dtype)
        rlp[row, p - 1 : p - 1 + n] = torch.tensor(rollout[i])
    return inp, tgt, mask, rlp


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped by similar length, each group's padded size within `budget` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[i] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def grpo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    seqs: list[list[int]],
    starts: list[int],
    rollout: list[list[float]],
    groups: list[int],
    rewards: list[float],
    cfg: GRPOConfig = GRPOConfig(),
    *,
    epochs: int = 1,
    minibatches: int = 1,
    micro_batch_tokens: int = 16384,
    max_grad_norm: float | None = 1.0,
    loss_masks: list[list[int]] | None = None,
) -> tuple[float, dict[str, float]]:
    """GRPO/DAPO on one batch: `epochs` passes, each split into `minibatches` optimizer steps
    (by prompt group). Sequence i is prompt + response, the response starting at `starts[i]`
    with rollout log-probs `rollout[i]`; `groups[i]` names its prompt group.

    One step (1 x 1) is the plain on-policy update. More steps reuse each rollout several
    times (PPO epochs and minibatches): π_old is the model as it entered this call, its
    log-probs computed once before the first step, and the clip bounds how far the policy
    moves from it. `loss_masks[i]` (per response token) leaves out the tokens the model did not
    generate (multi-turn: the environment's observations). Returns (mean loss per optimizer
    step, per-token metrics)."""
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), cfg.adv_eps)
    dev = next(model.parameters()).device
    gids = sorted(set(groups))
    k = max(1, min(minibatches, len(gids)))
    reuse = epochs * k > 1
    # prepared micro-batches per minibatch, with π_old's log-probs when the batch is reused
    Prepared = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
    mbs: list[list[Prepared]] = []
    for part in range(k):
        chosen = set(gids[part::k])
        rows = [i for i, g in enumerate(groups) if g in chosen]
        prepared: list[Prepared] = []
        for sub in micro_batches([len(seqs[i]) for i in rows], micro_batch_tokens):
            idx = [rows[j] for j in sub]
            inp, tgt, mask, rlp = (t.to(dev) for t in _pad(seqs, starts, rollout, idx, loss_masks))
            old = None
            if reuse:
                with torch.no_grad():
                    old = token_logprobs(_logits(model(inp)), tgt, cfg.temperature)[0]
            prepared.append((inp, tgt, mask, rlp, adv[idx].to(dev), old))
        mbs.append(prepared)
    model.train()
    losses: list[float] = []
    sums: dict[str, float] = {"entropy": 0.0}
    grad_norms: list[float] = []
    for _ in range(epochs):
        for prepared in mbs:
            n_tokens = max(sum(float(p[2].sum()) for p in prepared), 1.0)
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for inp, tgt, mask, rlp, a, old in prepared:
                logp, entropy = token_logprobs(_logits(model(inp)), tgt, cfg.temperature)
                loss, part_sums = policy_loss(
                    logp, logp.detach() if old is None else old, rlp, a, mask, cfg, num_tokens=n_tokens
                )
                loss.backward()
                step_loss += float(loss.detach())
                for key, val in part_sums.items():
                    sums[key] = sums.get(key, 0.0) + val
                sums["entropy"] += float((entropy * mask).sum())
            if max_grad_norm is not None:
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
            optimizer.step()
            losses.append(step_loss)
    model.eval()
    metrics = summarize(sums)
    if grad_norms:
        metrics["grad_norm"] = grad_norms[0]  # the first step's: the on-policy gradient
    metrics["adv_abs_mean"] = float(adv.abs().mean()) if len(adv) else 0.0
    metrics["optimizer_steps"] = float(len(losses))
    return sum(losses) / max(len(losses), 1), metrics


def _logits(out: object) -> torch.Tensor:
    """The tiny model returns logits; a Hugging Face model an output object holding them."""
    return out if isinstance(out, torch.Tensor) else out.logits  # type: ignore[attr-defined]
