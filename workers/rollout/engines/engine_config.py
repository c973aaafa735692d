"""Engine arguments from `--engine-config FILE` (TOML) and `--engine-arg key=value` overrides.

The vllm engine passes every field to vLLM's `AsyncEngineArgs`; the hf engine maps the few
that apply to it (ENGINE_HF) and refuses the rest. Keys are checked before any model is
loaded: against the dataclass fields of vLLM's `AsyncEngineArgs` where vLLM imports, and
against VLLM_ARGS (a documented subset of those fields) where it does not, so a typo fails on
a CPU-only launcher with the list of valid keys rather than on the GPU node minutes later.

This module needs neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# The AsyncEngineArgs fields accepted when vLLM is not importable (all exist in vLLM 0.32/0.33).
# With vLLM installed, every field of its AsyncEngineArgs is accepted instead.
VLLM_ARGS = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "gpu_memory_utilization",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enforce_eager",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "block_size",
        "swap_space",
        "cpu_offload_gb",
        "seed",
        "tokenizer",
        "revision",
        "trust_remote_code",
        "download_dir",
        "load_format",
        "distributed_executor_backend",
        "disable_custom_all_reduce",
        "max_logprobs",
        "logprobs_mode",
    }
)
# Set by the rollout worker itself: the model comes from --vllm-model/--model, and the worker
# extension is how the vLLM workers pull weights from the parameter server.
VLLM_RESERVED = {
    "model": "pass the model with --vllm-model (or --model)",
    "worker_extension_cls": "the rollout worker installs its own (weight pulls from the parameter server)",
}
# The hf engine's equivalents: engine-config key -> HFEngine keyword.
ENGINE_HF = {"dtype": "dtype", "device": "device", "max_model_len": "max_len", "max_num_seqs": "max_running"}
HF_DTYPES = ("float32", "float16", "bfloat16", "float", "half")


class EngineConfigError(ValueError):
    """A bad engine config file or --engine-arg; the message names the key and the valid ones."""


def parse_value(text: str) -> Any:
    """A TOML scalar (`2`, `0.9`, `true`, `"auto"`); a bare word is taken as a string."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if not text or any(c in text for c in "\"'[]{}=\n"):
            raise EngineConfigError(f"not a TOML scalar: {text!r}") from None
        return text  # e.g. dtype=bfloat16
    if isinstance(value, (dict, list)):
        raise EngineConfigError(f"--engine-arg takes scalars (int, float, bool, string), not {text!r}")
    return value


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`key=value` pairs (later ones win)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise EngineConfigError(f"--engine-arg takes key=value, got {item!r}")
        out[key.replace("-", "_")] = parse_value(value.strip())
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    """A flat TOML table of engine arguments (an `[engine]` table is accepted too)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise EngineConfigError(f"cannot read the engine config {p}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise EngineConfigError(f"{p} is not valid TOML: {e}") from None
    if set(data) == {"engine"} and isinstance(data["engine"], dict):
        data = data["engine"]
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def engine_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The file's arguments with the --engine-arg overrides on top (not validated yet)."""
    cfg = load_file(path) if path is not None else {}
    cfg.update(parse_overrides(overrides))
    return cfg


def vllm_fields() -> frozenset[str] | None:
    """The dataclass fields of vLLM's AsyncEngineArgs; None where vLLM does not import."""
    try:
        from vllm import AsyncEngineArgs
    except ImportError:
        return None
    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def _unknown(kind: str, keys: Iterable[str], valid: Iterable[str]) -> EngineConfigError:
    valid = sorted(valid)
    hints = []
    for k in keys:
        close = difflib.get_close_matches(k, valid, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return EngineConfigError(f"unknown {kind} engine argument {', '.join(hints)}; valid: {', '.join(valid)}")


def check_vllm(cfg: Mapping[str, Any], fields: Iterable[str] | None = None) -> dict[str, Any]:
    """`cfg` if every key is an AsyncEngineArgs field (`fields`, default: vLLM's own where it
    imports, else VLLM_ARGS) and none is one the worker sets itself; else EngineConfigError."""
    for k, why in VLLM_RESERVED.items():
        if k in cfg:
            raise EngineConfigError(f"engine argument {k!r} cannot be set: {why}")
    valid = set(fields if fields is not None else (vllm_fields() or VLLM_ARGS)) - set(VLLM_RESERVED)
    bad = [k for k in cfg if k not in valid]
    if bad:
        raise _unknown("vllm", bad, valid)
    return dict(cfg)


def vllm_kwargs(cfg: Mapping[str, Any], max_num_seqs: int) -> dict[str, Any]:
    """AsyncEngineArgs keywords besides the model: --max-running is `max_num_seqs` unless the
    config sets it."""
    return {"max_num_seqs": max_num_seqs, **check_vllm(cfg)}


def hf_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """HFEngine keywords for the engine arguments that apply to it (ENGINE_HF); the dtype stays
    a name (HFEngine turns it into a torch dtype)."""
    bad = [k for k in cfg if k not in ENGINE_HF]
    if bad:
        raise EngineConfigError(
            f"the hf engine does not take engine argument {', '.join(map(repr, bad))}; "
            f"it takes: {', '.join(ENGINE_HF)} (the rest are vLLM's)"
        )
    out = {ENGINE_HF[k]: v for k, v in cfg.items()}
    if "dtype" in out and out["dtype"] not in HF_DTYPES:
        raise EngineConfigError(f"hf engine dtype {out['dtype']!r}: use one of {', '.join(HF_DTYPES)}")
    for k in ("max_model_len", "max_num_seqs"):
        v = cfg.get(k, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise EngineConfigError(f"engine argument {k!r} must be a positive integer, got {v!r}")
    if "device" in out and not isinstance(out["device"], str):
        raise EngineConfigError(f"engine argument 'device' must be a string, got {out['device']!r}")
    return out
