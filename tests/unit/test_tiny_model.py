"""The tiny transformer: cached path == full path, and bit-exact invariance to batching,
prefill/decode split and model instance -- the property interrupt-and-continue rests on."""

from __future__ import annotations

import math

import pytest
import torch

from workers.models.tiny_model import (
    KVCacheFull,
    KVPool,
    TinyConfig,
    TinyTransformer,
    generate,
    sample_tokens,
    uniform,
)

CFG = TinyConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, max_seq=96, eos_token_id=0)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CFG, seed=7)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt) % (CFG.vocab_size - 1) for i in range(n)]


def test_cached_logits_match_full_forward(model):
    seq = _prompt(20)
    full = model(torch.tensor([seq]))[0]
    pool = KVPool(CFG, 64, block_size=8)
    c = pool.new_sequence()
    rows = [model.prefill(c, seq[:5])]
    rows += [model.decode([c], [t])[0] for t in seq[5:]]
    torch.testing.assert_close(torch.stack(rows), full[4:], rtol=1e-4, atol=1e-4)
    assert c.length == len(seq) == pool.tokens_held


def test_prefill_and_decode_are_bitwise_identical(model):
    seq = _prompt(30, salt=3)
    pool = KVPool(CFG, 128, block_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    whole = model.prefill(a, seq)
    model.prefill(b, seq[:1])
    for t in seq[1:-1]:
        model.decode([b], [t])
    stepwise = model.decode([b], [seq[-1]])[0]
    assert torch.equal(whole, stepwise)
    # and the stored K/V agree too
    for li in range(CFG.n_layers):
        assert torch.equal(pool.k[li][a.slot_idx[: a.length]], pool.k[li][b.slot_idx[: b.length]])


def test_decode_row_does_not_depend_on_batch(model):
    pool = KVPool(CFG, 512, block_size=8)
    seqs = [_prompt(n, salt=n) for n in (3, 17, 9, 40, 2, 25)]
    caches = [pool.new_sequence() for _ in seqs]
    for c, s in zip(caches, seqs):
        model.prefill(c, s[:-1])
    batched = model.decode(caches, [s[-1] for s in seqs])
    for i, s in enumerate(seqs):
        alone_pool = KVPool(CFG, 64, block_size=16)  # other block size, other pool
        c = alone_pool.new_sequence()
        assert torch.equal(model.prefill(c, s), batched[i])


def test_same_weights_on_another_instance_give_identical_continuation(model):
    prompt = _prompt(6, salt=1)
    toks, lps = generate(model, prompt, max_new_tokens=40, seed=1234)
    other = TinyTransformer(CFG, seed=99)
    other.load_state_dict(model.state_dict())
    k = len(toks) // 2
    cont, cont_lp = generate(other, prompt + toks[:k], max_new_tokens=len(toks) - k, seed=1234)
    assert toks[:k] + cont == toks
    assert lps[:k] + cont_lp == lps


def test_generation_ends_at_eos_or_max_new_tokens(model):
    reasons = set()
    for seed in range(40):
        toks, lps = generate(model, _prompt(4, salt=seed), max_new_tokens=12, seed=seed)
        assert len(toks) == len(lps) and 1 <= len(toks) <= 12
        assert CFG.eos_token_id not in toks[:-1]
        reasons.add("eos" if toks[-1] == CFG.eos_token_id else "length")
        assert all(lp <= 0 for lp in lps)
    assert reasons == {"eos", "length"}  # both endings occur with this small vocabulary


def test_generation_stops_at_max_seq(model):
    toks, _ = generate(model, _prompt(CFG.max_seq - 3), max_new_tokens=50, seed=5)
    assert len(toks) <= 3


def test_sampling_depends_only_on_seed_and_position():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(0))
    a = [sample_tokens(logits, [11], [p])[0][0] for p in range(50)]
    b = [sample_tokens(logits.repeat(3, 1), [11, 12, 11], [p, p, p])[0][2] for p in range(50)]
    c = [sample_tokens(logits, [12], [p])[0][0] for p in range(50)]
    assert a == b and a != c
    assert uniform(3, 4) == uniform(3, 4) and 0 <= uniform(3, 4) < 1


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temp in (1.0, 0.5):
        probs = torch.softmax(logits[0] / temp, dim=-1)
        n = 4000
        counts = torch.zeros(4)
        for p in range(n):
            (t,), (lp,) = sample_tokens(logits, [77], [p], temperature=temp)
            counts[t] += 1
            assert math.isclose(lp, math.log(probs[t].item()), rel_tol=1e-5)
        # 5 standard deviations of a binomial count: fails only if sampling is wrong
        sd = (n * probs * (1 - probs)).sqrt()
        assert ((counts - n * probs).abs() <= 5 * sd + 1).all(), (counts, n * probs)
    (t,), _ = sample_tokens(logits, [1], [0], temperature=0)
    assert t == 0


def test_kv_pool_accounting_and_exhaustion(model):
    pool = KVPool(CFG, 32, block_size=8)  # 4 blocks
    a, b = pool.new_sequence(), pool.new_sequence()
    model.prefill(a, _prompt(9))  # 2 blocks
    model.prefill(b, _prompt(8))  # 1 block
    assert (pool.tokens_held, pool.free_blocks) == (17, 1)
    model.decode([a, b], [1, 2])  # b needs a second block: takes the last one
    assert (pool.tokens_held, pool.free_blocks, len(b.blocks)) == (19, 0, 2)
    with pytest.raises(KVCacheFull):
        model.prefill(pool.new_sequence(), [1])
    assert pool.tokens_held == 19  # a failed reservation changes nothing
    a.release()
    assert (pool.tokens_held, pool.free_blocks, a.length) == (9, 2, 0)
