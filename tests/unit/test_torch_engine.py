"""The `torch` engine: continuous batching, interrupt/continue (also on a second
instance), batch-independence, real KV accounting, preemption and weight loading."""

from __future__ import annotations

import pytest

from workers.models.tiny_model import TinyConfig, TinyTransformer, generate
from workers.rollout.engines.base import FinishedEvent, PreemptedEvent, TokensEvent
from workers.rollout.engines.torch_engine import TorchEngine

CFG = TinyConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, max_seq=128, eos_token_id=0)
MAX_NEW = 40


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt(i: int) -> list[int]:
    return [1 + (i * 5 + j * 3) % (CFG.vocab_size - 1) for j in range(3 + (i * 7) % 13)]


def _engine(**kw) -> TorchEngine:
    kw.setdefault("model_seed", 3)
    return TorchEngine(CFG, **kw)


def _check_kv(e: TorchEngine) -> None:
    """Reported KV usage == what the caches hold == what each running sample implies."""
    s = e.stats()
    held = sum(r.cache.length for r in e._running)
    assert s.kv_tokens == held == e.pool.tokens_held
    # a running sample holds all its tokens but the newest one (fed next step)
    assert held == sum(n - 1 for n in s.running_tokens.values())
    used_blocks = sum(len(r.cache.blocks) for r in e._running)
    assert used_blocks == e.pool.num_blocks - e.pool.free_blocks
    assert s.kv_tokens <= e.capacity().kv_capacity == e.pool.capacity_tokens


def _run(e: TorchEngine, max_steps: int = 10_000, check=True) -> dict[str, FinishedEvent]:
    done: dict[str, FinishedEvent] = {}
    streamed: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not e.has_work():
            return done
        for ev in e.step():
            if isinstance(ev, TokensEvent):
                streamed.setdefault(ev.sample_id, []).extend(ev.tokens)
            elif isinstance(ev, FinishedEvent):
                done[ev.sample_id] = ev
                seen = streamed.pop(ev.sample_id, [])  # steps run before _run are unseen
                assert seen and ev.tokens[len(ev.tokens) - len(seen) :] == seen
        if check:
            _check_kv(e)
    raise AssertionError("engine did not drain")


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[int], list[float]]]:
    """Uninterrupted single-sequence generations, the ground truth for every test."""
    m = TinyTransformer(CFG, seed=3)
    return {f"s{i}": generate(m, _prompt(i), MAX_NEW, seed=100 + i) for i in range(8)}


def _add_all(e: TorchEngine, ids=range(8)) -> None:
    for i in ids:
        e.add_request(f"s{i}", _prompt(i), max_new_tokens=MAX_NEW, seed=100 + i)


def test_batched_run_matches_single_sequence_generation(reference):
    e = _engine()
    _add_all(e)
    done = _run(e)
    for sid, (toks, lps) in reference.items():
        assert (done[sid].tokens, done[sid].logprobs) == (toks, lps)
        assert done[sid].finish_reason == ("eos" if toks[-1] == CFG.eos_token_id else "length")
    assert {d.finish_reason for d in done.values()} == {"eos", "length"}
    assert e.stats().kv_tokens == 0 and e.stats().tokens_per_s > 0


def test_batch_composition_does_not_change_a_sample(reference):
    alone = _engine()
    _add_all(alone, ids=[5])
    crowd = _engine(kv_capacity_tokens=4096, block_size=4)
    _add_all(crowd, ids=[7, 2])
    crowd.step()  # s5 joins a batch that is already mid-flight
    _add_all(crowd, ids=[5, 0, 1])
    assert _run(alone)["s5"].tokens == _run(crowd)["s5"].tokens == reference["s5"][0]


@pytest.mark.parametrize("second_instance", [False, True])
def test_interrupt_and_continue_equals_uninterrupted(reference, second_instance):
    e = _engine()
    _add_all(e)
    early = {}
    for _ in range(6):
        early.update({ev.sample_id: ev for ev in e.step() if isinstance(ev, FinishedEvent)})
    parts = {p.sample_id: p for p in e.interrupt(["s1", "s3", "nope"])}
    assert set(parts) == {"s1", "s3"} and all(len(p.tokens) == 6 for p in parts.values())
    _check_kv(e)
    # continue s1 on the same engine or on a fresh instance with the same weights but a
    # different seed-initialised model, KV size and batch; s3 continues twice in a row
    other = e
    if second_instance:
        other = _engine(model_seed=999, kv_capacity_tokens=1024, block_size=8)
        other.load_weights(e.model.state_dict(), version=e.version)
        _add_all(other, ids=[6])  # ... s6 runs on both engines; its result must agree
    p1, p3 = parts["s1"], parts["s3"]
    other.add_request("s1", _prompt(1), p1.tokens, p1.logprobs, MAX_NEW - len(p1.tokens), seed=101)
    other.add_request("s3", _prompt(3), p3.tokens, p3.logprobs, MAX_NEW - len(p3.tokens), seed=103)
    for _ in range(4):
        other.step()
    (p3b,) = other.interrupt(["s3"])
    assert p3b.prefix_len == 6
    pre3 = p3.tokens + p3b.tokens
    pre3_lp = p3.logprobs + p3b.logprobs
    other.add_request("s3", _prompt(3), pre3, pre3_lp, MAX_NEW - len(pre3), seed=103)
    done = {**early, **_run(other)}
    if second_instance:
        done.update(_run(e))
    assert p1.tokens + done["s1"].tokens == reference["s1"][0]
    assert p1.logprobs + done["s1"].logprobs == reference["s1"][1]
    assert pre3 + done["s3"].tokens == reference["s3"][0]
    assert pre3_lp + done["s3"].logprobs == reference["s3"][1]
    assert done["s1"].prefix_len == 6
    for sid in ("s0", "s2", "s6"):
        assert done[sid].tokens == reference[sid][0]


def test_preemption_when_kv_runs_out_and_preempted_samples_finish(reference):
    e = _engine(kv_capacity_tokens=96, block_size=8)
    _add_all(e)
    preempted = []
    done = {}
    while e.has_work():
        for ev in e.step():
            if isinstance(ev, PreemptedEvent):
                preempted.append(ev)
                # no admission happens in a step that preempted, so this is exact
                assert ev.waiting == e.stats().waiting
            elif isinstance(ev, FinishedEvent):
                done[ev.sample_id] = ev
        _check_kv(e)
        assert e.stats().kv_tokens <= 96
    assert preempted and e.stats().preemptions == len(preempted)
    for sid, (toks, lps) in reference.items():
        assert (done[sid].tokens, done[sid].logprobs) == (toks, lps)


def test_preempted_sample_can_be_interrupted_with_its_tokens(reference):
    """The `φ_wait` rule: on a PreemptedEvent the worker interrupts the waiting sample."""
    e = _engine(kv_capacity_tokens=96, block_size=8)
    _add_all(e)
    while True:
        pre = [ev for ev in e.step() if isinstance(ev, PreemptedEvent)]
        if pre:
            break
    sid = pre[0].sample_id
    (part,) = e.interrupt([sid])
    ref_toks, ref_lps = reference[sid]
    assert part.tokens == ref_toks[: len(part.tokens)] and len(part.tokens) > 0
    assert part.logprobs == ref_lps[: len(part.tokens)]
    assert len(_prompt(int(sid[1:]))) + len(part.tokens) == pre[0].num_tokens
    assert sid not in _run(e)


def test_load_weights_changes_outputs(reference):
    e = _engine()
    new = TinyTransformer(CFG, seed=4).state_dict()
    e.load_weights(new, version=5)
    assert e.version == 5 and e.stats().version == 5
    _add_all(e, ids=[0, 1, 2])
    done = _run(e)
    fresh = _engine(model_seed=4)
    _add_all(fresh, ids=[0, 1, 2])
    ref_new = _run(fresh)
    for sid in ("s0", "s1", "s2"):
        assert done[sid].tokens == ref_new[sid].tokens
    assert any(done[s].tokens != reference[s][0] for s in ("s0", "s1", "s2"))


def test_abort_frees_kv_and_unknown_ids_are_ignored():
    e = _engine()
    _add_all(e, ids=[1, 3, 4])  # none of these ends at its first token
    e.step()
    assert e.stats().running == 3 and e.stats().kv_tokens > 0
    e.abort(["s1", "s3", "s4", "zzz"])
    assert (e.stats().running, e.stats().kv_tokens, e.step()) == (0, 0, [])


def test_admission_respects_capacity_and_max_running():
    e = _engine(kv_capacity_tokens=64, block_size=16, max_running=2)
    for i in range(4):
        e.add_request(f"r{i}", [1] * 20, max_new_tokens=5, seed=i)  # 2 blocks each
    e.step()
    s = e.stats()
    assert (s.running, s.waiting) == (2, 2) and set(s.running_tokens) == {"r0", "r1"}
    assert s.running_tokens == {"r0": 21, "r1": 21}


def test_edge_requests():
    e = _engine(kv_capacity_tokens=64, block_size=16)
    e.add_request("full", [1] * CFG.max_seq, max_new_tokens=5)
    e.add_request("zero", [1, 2], max_new_tokens=0)
    evs = e.step()
    assert [(ev.sample_id, ev.tokens, ev.finish_reason) for ev in evs] == [
        ("full", [], "length"),
        ("zero", [], "length"),
    ]
    with pytest.raises(ValueError):
        e.add_request("big", [1] * 70)  # never fits 64 KV tokens
    with pytest.raises(ValueError):
        e.add_request("bad", [CFG.vocab_size])
    e.add_request("dup", [1])
    with pytest.raises(ValueError, match="already in the engine"):
        e.add_request("dup", [1])
    with pytest.raises(ValueError, match="empty prompt"):
        e.add_request("empty", [])


def test_sample_outgrowing_the_whole_cache_finishes_with_capacity():
    e = _engine(kv_capacity_tokens=32, block_size=16)
    e.add_request("long", [2, 5, 7, 9, 11, 3, 4, 6, 8, 10], max_new_tokens=100, seed=1)
    done = _run(e)["long"]  # seed 1 runs past 32 tokens without EOS
    # 32 cached tokens and the one sampled from the last of them; no slot to feed it
    assert done.finish_reason == "capacity" and 10 + len(done.tokens) == 33
    assert e.stats().kv_tokens == 0
