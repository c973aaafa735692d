"""The GRPO/DAPO loss on hand-made tensors: group-normalized advantages, asymmetric clipping,
the TIS cap, token-mean weighting, and one real optimizer step on a tiny transformer."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from workers.models.tiny_model import TinyConfig, TinyTransformer
from workers.trainer.grpo import GRPOConfig, group_advantages, grpo_update, policy_loss, summarize, token_logprobs


def test_advantages_are_zero_mean_unit_std_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 7.0, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups)
    for g in (0, 1):
        a = adv[groups == g]
        assert float(a.mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(a.std()) == pytest.approx(1.0, rel=1e-4)
    assert float(adv[6]) == pytest.approx(3.0, rel=1e-5)  # a lone sample has no baseline: raw reward
    # equal rewards carry no signal (DAPO's filter drops such groups; here they weigh 0)
    same = group_advantages(torch.tensor([2.0, 2.0, 2.0]), torch.tensor([0, 0, 0]))
    assert torch.equal(same, torch.zeros(3))


def _one_token(ratio: float, adv: float, cfg=GRPOConfig(tis_cap=None)):
    old = torch.tensor([[math.log(0.4)]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    loss, sums = policy_loss(logp, old, old, torch.tensor([adv]), torch.ones(1, 1), cfg)
    loss.backward()
    return float(loss.detach()), float(logp.grad), sums


@pytest.mark.parametrize(
    "ratio, adv, clipped",
    [
        (1.25, 1.0, False),  # inside 1 + ε_high = 1.28: still pushed up
        (1.30, 1.0, True),  # past 1.28: clipped, no gradient
        (0.75, 1.0, False),  # positive advantage is never clipped from below
        (0.85, -1.0, False),  # inside 1 - ε_low = 0.8
        (0.75, -1.0, True),  # past 0.8: clipped
        (1.30, -1.0, False),  # negative advantage is never clipped from above
    ],
)
def test_clipping_is_asymmetric(ratio, adv, clipped):
    loss, grad, sums = _one_token(ratio, adv)
    bound = min(ratio, 1.28) if adv > 0 else max(ratio, 0.8)
    assert loss == pytest.approx(-bound * adv if clipped else -ratio * adv, rel=1e-5)
    assert sums["clipped"] == (1.0 if clipped else 0.0)
    if clipped:
        assert grad == 0.0
    else:  # d(-r·A)/d logp = -r·A
        assert grad == pytest.approx(-ratio * adv, rel=1e-5)


def test_clip_bounds_are_configurable():
    _, grad, _ = _one_token(1.30, 1.0, GRPOConfig(clip_high=0.5, tis_cap=None))
    assert grad != 0.0  # 1.3 < 1.5: not clipped any more


def test_tis_weight_is_capped_and_carries_no_gradient():
    old = torch.log(torch.tensor([[0.6, 0.6, 0.6]]))
    rollout = torch.log(torch.tensor([[0.2, 0.4, 0.9]]))  # weights 3 -> 2 (cap), 1.5, 2/3
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0])
    loss, sums = policy_loss(logp, old, rollout, adv, torch.ones(1, 3), GRPOConfig(tis_cap=2.0))
    loss.backward()
    expected = torch.tensor([2.0, 1.5, 2 / 3])
    # ratio 1, A = 1: each token's loss is -weight, and so is its gradient (weight detached)
    assert float(loss.detach()) == pytest.approx(-float(expected.mean()), rel=1e-5)
    assert logp.grad[0].tolist() == pytest.approx((-expected / 3).tolist(), rel=1e-5)
    assert sums["tis_capped"] == 1.0
    assert summarize(sums)["tis_mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
    # without TIS every token weighs 1
    loss_off, _ = policy_loss(old.clone(), old, rollout, adv, torch.ones(1, 3), GRPOConfig(tis_cap=None))
    assert float(loss_off) == pytest.approx(-1.0)


def test_token_mean_weighs_every_token_the_same():
    # sequence A: 1 response token, advantage +1; sequence B: 3 tokens, advantage -1
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, sums = policy_loss(old.clone(), old, old, adv, mask, GRPOConfig(tis_cap=None))
    assert sums["tokens"] == 4
    assert float(loss) == pytest.approx((-1 + 3) / 4)  # not the mean of per-sequence means (0)
    # micro-batching with the whole batch's token count sums to the same loss
    part = [
        policy_loss(
            old[i : i + 1],
            old[i : i + 1],
            old[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            GRPOConfig(tis_cap=None),
            num_tokens=4,
        )[0]
        for i in range(2)
    ]
    assert float(sum(part)) == pytest.approx(float(loss))


def test_one_step_raises_the_probability_of_the_better_response():
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq=16)
    model = TinyTransformer(cfg, seed=1).requires_grad_(True)
    prompt = [3, 4]
    good, bad = [5, 6, 7], [8, 9, 10]
    seqs = torch.tensor([prompt + good, prompt + bad])
    targets = seqs[:, 1:]
    mask = torch.tensor([[0.0, 1, 1, 1]] * 2)  # response tokens only

    def seq_logp():
        with torch.no_grad():
            lp, _ = token_logprobs(model(seqs[:, :-1]), targets)
        return (lp * mask).sum(-1)

    before = seq_logp()
    adv = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert adv[0] > 0 > adv[1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logp, entropy = token_logprobs(model(seqs[:, :-1]), targets)
    loss, _ = policy_loss(logp, logp.detach(), logp.detach(), adv, mask)
    assert entropy.shape == logp.shape and not entropy.requires_grad
    opt.zero_grad()
    loss.backward()
    opt.step()
    after = seq_logp()
    assert after[0] > before[0]  # the positively-advantaged response became more likely
    assert after[1] < before[1]


def _update(epochs: int, minibatches: int):
    cfg = TinyConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq=16)
    model = TinyTransformer(cfg, seed=1).requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # small steps: the clip stays out of reach
    seqs = [[3, 4, 5, 6, 7], [3, 4, 8, 9, 10], [3, 11, 5, 5], [3, 11, 12]]
    rollout = [[-2.7] * 3, [-2.7] * 3, [-2.7] * 2, [-2.7]]
    args = (seqs, [2, 2, 2, 2], rollout, [0, 0, 1, 1], [1.0, 0.0, 1.0, 0.0])

    def logp(i: int) -> float:
        with torch.no_grad():
            x = torch.tensor([seqs[i]])
            lp, _ = token_logprobs(model(x[:, :-1]), x[:, 1:])
        return float(lp[0, 1:].sum())

    before = [logp(i) for i in range(4)]
    loss, metrics = grpo_update(model, opt, *args, GRPOConfig(tis_cap=None), epochs=epochs, minibatches=minibatches)
    return before, [logp(i) for i in range(4)], metrics, model


def test_update_takes_epochs_times_minibatches_steps_and_moves_further():
    before, one, m1, _ = _update(1, 1)
    _, four, m4, model = _update(4, 2)
    assert m1["optimizer_steps"] == 1 and m4["optimizer_steps"] == 8
    assert model.training is False
    for i in (0, 2):  # the better response of each group: more likely, more so with reuse
        assert four[i] - before[i] > one[i] - before[i] > 0
    for i in (1, 3):
        assert four[i] - before[i] < one[i] - before[i] < 0
    # later passes see a policy that moved: π/π_old differs from 1, and the clip engages
    assert m1["ratio_mean"] == pytest.approx(1.0) and m1["clip_frac"] == 0.0
    assert m4["ratio_mean"] != pytest.approx(1.0, abs=1e-4)


def test_the_loss_mask_trains_on_generated_tokens_only():
    """A multi-turn response: its observation tokens (mask 0) weigh nothing: whatever log-probs
    they carry, the update is the same, and it differs once they count."""
    cfg = TinyConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq=16)
    seqs = [[3, 4, 5, 13, 14, 6], [3, 4, 8, 13, 14, 9]]
    masks = [[1, 0, 0, 1], [1, 0, 0, 1]]

    def update(observed_logprob: float, loss_masks):
        model = TinyTransformer(cfg, seed=1).requires_grad_(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rollout = [[-2.7, observed_logprob, observed_logprob, -2.7]] * 2
        loss, m = grpo_update(
            model, opt, seqs, [2, 2], rollout, [0, 0], [1.0, 0.0], GRPOConfig(tis_cap=2.0), loss_masks=loss_masks
        )
        return loss, m["mismatch_mean"]

    assert update(0.0, masks) == update(-9.0, masks)
    assert update(0.0, None) != update(-9.0, None)
