"""The `hf` engine on a tiny Qwen2 folder built offline: batched decoding equals one-by-one,
interrupt + resume equals an uninterrupted run, log-probs equal a full forward pass (after
temperature), preemption under a small KV budget changes nothing, weights load by name."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_helpers import make_tiny_hf_model

from workers.models.hf import load_model, load_tokenizer
from workers.rollout.engines.base import FinishedEvent, PreemptedEvent
from workers.rollout.engines.hf_engine import HFEngine
from workers.tasks.text import repeat_prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def prompts(folder):
    return [t for _, t, _ in repeat_prompts(load_tokenizer(folder), 6, seed=1)]


def _run(e: HFEngine, prompts, seeds=None, max_new=MAX_NEW) -> dict[str, FinishedEvent]:
    for i, p in enumerate(prompts):
        e.add_request(f"s{i}", p, max_new_tokens=max_new, seed=(seeds or range(len(prompts)))[i])
    done: dict[str, FinishedEvent] = {}
    while e.has_work():
        for ev in e.step():
            if isinstance(ev, FinishedEvent):
                done[ev.sample_id] = ev
    return done


def _alone(folder, prompts, **kw) -> dict[str, FinishedEvent]:
    out = {}
    for i, p in enumerate(prompts):
        (ev,) = _run(HFEngine(folder, **kw), [p], seeds=[i]).values()
        out[f"s{i}"] = dataclasses.replace(ev, sample_id=f"s{i}")
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_decode_equals_one_by_one(folder, prompts, temperature):
    batched = _run(HFEngine(folder, temperature=temperature), prompts)
    alone = _alone(folder, prompts, temperature=temperature)
    assert batched.keys() == alone.keys()
    for sid, ev in batched.items():
        assert ev.tokens == alone[sid].tokens
        assert ev.logprobs == pytest.approx(alone[sid].logprobs, abs=1e-4)
        assert ev.finish_reason == alone[sid].finish_reason


def test_interrupt_then_resume_continues_identically(folder, prompts):
    whole = _run(HFEngine(folder, temperature=0.0), prompts[:3])
    e = HFEngine(folder, temperature=0.0)
    for i, p in enumerate(prompts[:3]):
        e.add_request(f"s{i}", p, max_new_tokens=MAX_NEW, seed=i)
    for _ in range(4):
        e.step()
    partials = {p.sample_id: p for p in e.interrupt(["s0", "s1", "s2"])}
    assert not e.has_work() and e.stats().kv_tokens == 0
    resumed = HFEngine(folder, temperature=0.0)  # another instance, same weights
    for i, p in enumerate(prompts[:3]):
        part = partials[f"s{i}"]
        resumed.add_request(f"s{i}", p, part.tokens, part.logprobs, max_new_tokens=MAX_NEW - len(part.tokens), seed=i)
    rest = {}
    while resumed.has_work():
        rest.update({ev.sample_id: ev for ev in resumed.step() if isinstance(ev, FinishedEvent)})
    for sid, ev in whole.items():
        part = partials[sid]
        assert part.tokens + rest[sid].tokens == ev.tokens
        assert part.logprobs + rest[sid].logprobs == pytest.approx(ev.logprobs, abs=1e-4)
        assert rest[sid].prefix_len == len(part.tokens)


def test_logprobs_match_a_full_forward_pass(folder, prompts):
    temperature = 0.7
    done = _run(HFEngine(folder, temperature=temperature), prompts[:3])
    model = load_model(folder)
    for i, p in enumerate(prompts[:3]):
        ev = done[f"s{i}"]
        seq = torch.tensor([p + ev.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=seq).logits[0].float() / temperature, dim=-1)
        want = [float(logp[len(p) - 1 + t, tok]) for t, tok in enumerate(ev.tokens)]
        assert ev.logprobs == pytest.approx(want, abs=1e-4)


def test_preemption_under_a_small_kv_budget_changes_no_token(folder, prompts):
    free = _run(HFEngine(folder, temperature=1.0), prompts)
    e = HFEngine(folder, temperature=1.0, kv_capacity_tokens=60, max_running=4)
    for i, p in enumerate(prompts):
        e.add_request(f"s{i}", p, max_new_tokens=MAX_NEW, seed=i)
    done, preempted = {}, 0
    while e.has_work():
        s = e.stats()
        assert s.kv_tokens <= e.capacity().kv_capacity and s.running <= 4
        for ev in e.step():
            preempted += isinstance(ev, PreemptedEvent)
            if isinstance(ev, FinishedEvent):
                done[ev.sample_id] = ev
    assert preempted > 0
    assert {k: v.tokens for k, v in done.items()} == {k: v.tokens for k, v in free.items()}


def test_weights_load_by_state_dict_name(folder, prompts):
    other = make_tiny_hf_model(folder.parent / "other", seed=7)
    e = HFEngine(folder, temperature=1.0)
    e.load_weights(load_model(other).state_dict(), version=3)
    assert e.version == 3
    got, want = _run(e, prompts[:2]), _alone(other, prompts[:2], temperature=1.0)
    before = _alone(folder, prompts[:2], temperature=1.0)
    for sid, ev in got.items():
        assert ev.tokens == want[sid].tokens
        assert ev.logprobs == pytest.approx(want[sid].logprobs, abs=1e-4)
        assert ev.logprobs != pytest.approx(before[sid].logprobs, abs=1e-3)


def test_eos_ends_a_sample(folder, prompts):
    e = HFEngine(folder, temperature=1.0)
    eos = next(iter(e.eos))
    with torch.no_grad():  # make EOS the only likely token
        e.model.lm_head.weight[eos] += 100.0 * e.model.lm_head.weight[eos].sign()
    (ev,) = _run(e, prompts[:1]).values()
    assert ev.finish_reason == "eos" and ev.tokens[-1] == eos


def test_the_trainer_sees_the_engines_logprobs(folder, prompts, tmp_path):
    """The GRPO trainer on the same folder: π_old equals π_rollout token by token (no TIS
    mismatch), micro batches of different widths included."""
    from workers.trainer.grpo import GRPOConfig
    from workers.trainer.torch_trainer import Trainer
    from workers.wire.models import BatchOut

    temperature = 0.7
    # two samples per prompt (seeds differ), one group per prompt
    done = _run(HFEngine(folder, temperature=temperature), [prompts[0], prompts[0], prompts[1], prompts[1]])
    groups = [
        {
            "group_id": g,
            "group_version": 0,
            "prompt_tokens": prompts[g],
            "meta": {},
            "samples": [
                {
                    "sample_id": 2 * g + j,
                    "idx": j,
                    "v_traj": 0,
                    "tokens": done[f"s{2 * g + j}"].tokens,
                    "logprobs": done[f"s{2 * g + j}"].logprobs,
                    "reward": float(j),
                    "finish_reason": done[f"s{2 * g + j}"].finish_reason,
                    "segments": [],
                    "loss_mask": [1] * len(done[f"s{2 * g + j}"].tokens),
                }
                for j in (0, 1)
            ],
        }
        for g in (0, 1)
    ]
    model = load_model(folder)
    trainer = Trainer(
        None,  # type: ignore[arg-type]  # train_batch needs no API
        1,
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        checkpoint_dir=tmp_path,
        grpo=GRPOConfig(temperature=temperature),
        micro_batch_tokens=40,
    )
    _, metrics = trainer.train_batch(BatchOut(run_id=1, version=0, consume_fence=1, groups=groups))
    assert metrics["mismatch_mean"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["tis_mean"] == pytest.approx(1.0, abs=1e-3)


def test_a_sample_that_outgrows_the_kv_cache_finishes_as_capacity(folder, prompts):
    p = prompts[0]
    e = HFEngine(folder, temperature=1.0, kv_capacity_tokens=len(p) + 4)
    (ev,) = _run(e, [p]).values()
    assert ev.finish_reason == "capacity" and len(ev.tokens) == 5  # the last one needs no K/V
    assert e.stats().kv_tokens == 0
    with pytest.raises(ValueError, match="never fit"):
        e.add_request("big", p + p)
    e.add_request("gone", p)
    e.step()
    e.abort(["gone", "unknown"])
    assert not e.has_work() and e.stats().kv_tokens == 0


def test_engine_config_keys_map_onto_the_hf_engine(folder, prompts):
    """--engine-config / --engine-arg for the hf engine: dtype by name, max_model_len caps
    prompt + response (a sample reaching it ends as "length"), max_num_seqs bounds the batch."""
    from workers.rollout.engines.engine_config import engine_config, hf_kwargs

    cap = len(prompts[0]) + 3
    kw = hf_kwargs(engine_config(None, ["dtype=bfloat16", f"max_model_len={cap}", "max_num_seqs=2", "device=cpu"]))
    e = HFEngine(folder, temperature=0.0, **kw)
    assert next(e.model.parameters()).dtype == torch.bfloat16 and e.max_running == 2
    e.add_request("a", prompts[0], max_new_tokens=50, seed=0)
    e.add_request("b", prompts[1], max_new_tokens=50, seed=1)
    e.add_request("c", prompts[2], max_new_tokens=50, seed=2)
    most_running, done = 0, {}
    while e.has_work():
        for ev in e.step():
            if isinstance(ev, FinishedEvent):
                done[ev.sample_id] = ev
        most_running = max(most_running, e.stats().running)
    assert most_running <= 2
    lengths = {sid: len(prompts["abc".index(sid)]) + len(ev.tokens) for sid, ev in done.items()}
    assert all(n <= cap for n in lengths.values()), lengths
    assert any(ev.finish_reason == "length" and lengths[sid] == cap for sid, ev in done.items()), done
