"""The vLLM adapter without vLLM (it needs GPUs): the module imports, the engine refuses to
start with a clear instruction, and vLLM's output records map to the same events the torch
engine emits for the same tokens. The records below are plain stand-ins for vLLM's
RequestOutput/CompletionOutput/Logprob *data* (their fields, nothing of the engine)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from workers.rollout.engines.base import FinishedEvent, TokensEvent
from workers.rollout.engines.vllm_engine import INSTALL_HINT, Stretch, VLLMEngine, VLLMUnavailable, sampled_logprobs

needs_no_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here (these check the adapter without it)"
)


def record(request_id, tokens, logprobs, finished=False, reason=None):
    """A RequestOutput of DELTA kind: the new tokens, each with its {token: Logprob} map
    (vLLM adds the top-k alternatives; with logprobs=0 only the sampled token)."""
    lp_maps = [
        {t: SimpleNamespace(logprob=lp), (t + 1) % 7: SimpleNamespace(logprob=-9.0)} for t, lp in zip(tokens, logprobs)
    ]
    comp = SimpleNamespace(token_ids=list(tokens), logprobs=lp_maps, finish_reason=reason)
    return SimpleNamespace(request_id=request_id, outputs=[comp], finished=finished)


@needs_no_vllm
def test_engine_without_vllm_fails_with_the_install_instruction():
    with pytest.raises(VLLMUnavailable, match=r"pip install 'staleflow\[vllm\]'") as err:
        VLLMEngine("Qwen/Qwen2.5-0.5B")
    assert isinstance(err.value, ImportError) and INSTALL_HINT in str(err.value)


def test_outputs_map_to_the_torch_engines_events():
    torch = pytest.importorskip("torch")  # noqa: F841 - the reference run needs it
    from workers.models.tiny_model import TinyConfig
    from workers.rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine(
        TinyConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, max_seq=64), model_seed=5, kv_capacity_tokens=1024
    )
    engine.add_request("7", [1, 2, 3], prefix_tokens=[4, 5], max_new_tokens=12, seed=7)
    ref = []
    while engine.has_work():
        ref += engine.step()
    (done,) = [e for e in ref if isinstance(e, FinishedEvent)]
    # the same stretch as vLLM would stream it: uneven deltas, then the finish
    st = Stretch("7", "7#0", context_len=5, prefix_len=2)
    vllm_reason = {"eos": "stop", "length": "length"}[done.finish_reason]
    cuts = [0, 1, 4, 5, len(done.tokens)]
    events = []
    for a, b in zip(cuts, cuts[1:]):
        last = b == len(done.tokens)
        events += st.absorb(
            record("7#0", done.tokens[a:b], done.logprobs[a:b], finished=last, reason=vllm_reason if last else None)
        )
    streamed = [e for e in events if isinstance(e, TokensEvent)]
    assert [t for e in streamed for t in e.tokens] == [t for e in ref if isinstance(e, TokensEvent) for t in e.tokens]
    assert events[-1] == done  # tokens, log-probs, reason and prefix length alike
    assert st.done and st.reported


def test_finish_reasons_and_abort():
    stop = Stretch("1", "1#0", 3, 0)
    (*_, fin) = stop.absorb(record("1#0", [4, 0], [-0.5, -0.1], finished=True, reason="stop"))
    assert fin == FinishedEvent("1", [4, 0], [-0.5, -0.1], "eos", 0)
    length = Stretch("2", "2#0", 3, 1)
    (*_, fin) = length.absorb(record("2#0", [4], [-0.5], finished=True, reason="length"))
    assert fin.finish_reason == "length" and fin.prefix_len == 1
    # our own abort (interrupt): tokens are kept, but it is not a finish
    aborted = Stretch("3", "3#0", 3, 0, stopping=True)
    events = aborted.absorb(record("3#0", [9], [-2.0], finished=True, reason="abort"))
    assert events == [TokensEvent("3", [9], [-2.0])] and aborted.tokens == [9] and not aborted.reported
    # vLLM's own abort, error and repetition stop are finishes under those names
    for reason in ("abort", "error", "repetition"):
        events = Stretch("5", "5#0", 3, 0).absorb(record("5#0", [9], [-2.0], finished=True, reason=reason))
        assert events[-1] == FinishedEvent("5", [9], [-2.0], reason, 0)
    # "length" with no token at all: vLLM never scheduled the prompt, ours is "capacity"
    assert Stretch("4", "4#0", 3, 0).absorb(record("4#0", [], [], finished=True, reason="length")) == [
        FinishedEvent("4", [], [], "capacity", 0)
    ]
    # an empty final delta after tokens carries the finish alone
    late = Stretch("6", "6#0", 3, 0)
    late.absorb(record("6#0", [4], [-0.5]))
    assert late.absorb(record("6#0", [], [], finished=True, reason="length")) == [
        FinishedEvent("6", [4], [-0.5], "length", 0)
    ]


def test_missing_logprobs_are_an_error():
    assert sampled_logprobs([{3: SimpleNamespace(logprob=-1.5)}], [3]) == [-1.5]
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_logprobs(None, [3])
