"""The vLLM rollout engine on a real GPU: the checks that cannot run on our CPU machines.

    python bench/gpu_check.py [--dir DIR] [--keep]

Needs a CUDA GPU, vLLM (`pip install -e '.[vllm]'`), transformers and tokenizers; nothing is
downloaded. It builds a tiny random Llama folder (transformers' LlamaConfig, 2 layers, and a
BPE tokenizer trained here with `tokenizers`, saved with save_pretrained), starts our parameter
server in-process, and checks, each printed as PASS/FAIL/SKIP:
  load_tp1 / load_tp2  the vLLM workers pull a version from the PS themselves (first load and a
                       later one) and then sample with it: log-probs match a transformers
                       forward pass with those weights, not with the folder's (TP2 needs 2 GPUs)
  interrupt            interrupt() of running samples returns partials with tokens and log-probs
  continuation         a greedy sample interrupted and continued from its partial (as the rollout
                       worker does, with other requests in the batch) equals the uninterrupted
                       run, under vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1, set here)
  finish_reasons       "length" at max_new_tokens, "eos" when the model samples its EOS
  kv_stats             KV capacity and usage from vLLM's scheduler stats, per-sample lengths
The last line is `gpu_check passed=P failed=F skipped=S`. Without a GPU or vLLM every check is
skipped with the reason and the exit status is 0; a failed check makes it 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

CHECKS = ("load_tp1", "load_tp2", "interrupt", "continuation", "finish_reasons", "kv_stats")
VOCAB, PROMPT = 512, "the quick brown fox jumps over"
ENGINE_KW: dict[str, Any] = dict(dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.25, max_model_len=256)


class Skip(Exception):
    """A check that cannot run here (and why)."""


def missing() -> str | None:
    """Why this machine cannot run the checks, or None."""
    for mod in ("torch", "vllm", "transformers", "tokenizers"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install -e '.[vllm]' on a GPU host)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


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


# ---- checks ----------------------------------------------------------------------------------
def check_load(folder: Path, ps: Any, prompt: list[int], tp: int) -> str:
    import torch

    if torch.cuda.device_count() < tp:
        raise Skip(f"tensor parallel {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
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
        raise Skip("every sample ended before 5 tokens")
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
        raise Skip(f"the greedy sample ends after {len(whole.tokens)} tokens: nothing to cut")
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
        raise Skip("every sample ended before 10 tokens")
    assert st.kv_capacity > 0 and 0 < st.kv_tokens <= st.kv_capacity, st
    assert st.running + st.waiting >= 1 and set(st.running_tokens) == running, st
    assert all(n >= len(prompt) + 10 for n in st.running_tokens.values()), st.running_tokens
    return f"kv {st.kv_tokens}/{st.kv_capacity} tokens, running={st.running}, {st.tokens_per_s:.0f} tok/s"


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
    ap.add_argument("--keep", action="store_true", help="keep the model folder and PS data")
    args = ap.parse_args()
    results: dict[str, tuple[str, str]] = {}
    why = missing()
    if why is not None:
        for name in CHECKS:
            results[name] = ("SKIP", why)
    else:
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")  # read by vLLM when it builds an engine
        # vLLM's worker processes import our worker extension by name
        root = str(Path(__file__).resolve().parents[1])
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        work = args.dir or Path(tempfile.mkdtemp(prefix="staleflow-gpu-check-"))
        try:
            run_checks(work, results)
        finally:
            if not args.keep and args.dir is None:
                shutil.rmtree(work, ignore_errors=True)
    for name in CHECKS:
        status, detail = results.get(name, ("SKIP", "not reached"))
        print(f"{status:4} {name}: {detail}", flush=True)
    n = {s: sum(1 for st, _ in results.values() if st == s) for s in ("PASS", "FAIL", "SKIP")}
    n["SKIP"] += len(CHECKS) - len(results)
    print(f"gpu_check passed={n['PASS']} failed={n['FAIL']} skipped={n['SKIP']}")
    return 1 if n["FAIL"] else 0


def run_checks(work: Path, results: dict[str, tuple[str, str]]) -> None:
    def run(name: str, fn: Callable[[], str]) -> None:
        print(f"... {name}", flush=True)
        try:
            results[name] = ("PASS", fn())
        except Skip as e:
            results[name] = ("SKIP", str(e))
        except Exception as e:  # one broken check must not hide the others
            traceback.print_exc()
            results[name] = ("FAIL", f"{type(e).__name__}: {e}")

    folder = work / "tiny-llama"
    model, tok = build_model(folder)
    CONFIG.append(model.config)
    prompt = tok(PROMPT)["input_ids"]
    ps = PS(work / "ps", {k: v.contiguous() for k, v in model.state_dict().items()})
    try:
        for tp in (1, 2):
            run(f"load_tp{tp}", lambda tp=tp: check_load(folder, ps, prompt, tp))
        # the PS's weights: the folder's make its EOS likely, which the finish-reason check uses
        eng = engine(folder, temperature=1.0, ps_addr=ps.addr)
        try:
            eng.load_from_ps(None)
            run("interrupt", lambda: check_interrupt(eng, prompt))
            run("kv_stats", lambda: check_kv_stats(eng, prompt))
        finally:
            eng.shutdown()
        greedy = engine(folder, temperature=0.0, ps_addr=ps.addr)
        try:
            run("finish_reasons", lambda: check_finish_reasons(greedy, prompt))
            greedy.load_from_ps(None)
            run("continuation", lambda: check_continuation(greedy, prompt))
        finally:
            greedy.shutdown()
    finally:
        ps.server.stop()


if __name__ == "__main__":
    sys.exit(main())
