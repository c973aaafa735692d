"""Hugging Face causal LMs: load a model folder (config + weights + tokenizer) the same way in
the trainer and the `hf` rollout engine, so the parameter server's state-dict names match on
both sides. A user with a real checkpoint folder changes only the path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from workers.extras import require


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """AutoModelForCausalLM from a folder, on `device` in `dtype` (float32 by default: the
    trainer's and the engine's log-probs must agree, and CPUs are slow in half precision)."""
    transformers = require("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(path: str | os.PathLike) -> Any:
    return require("transformers").AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(model: Any, tokenizer: Any = None) -> set[int]:
    """Every id that ends a response: the generation config's (one id or a list, e.g. a chat
    model's end-of-turn), the model config's and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, Sequence):
            ids.update(int(e) for e in eos)
    if not ids:
        raise ValueError("the model folder names no EOS token (config, generation config or tokenizer)")
    return ids


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's position encoding supports (None: not stated)."""
    n = getattr(
        config.get_text_config() if hasattr(config, "get_text_config") else config, "max_position_embeddings", None
    )
    return int(n) if n else None


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt token ids as the model expects them: through its chat template when it has one
    (one user turn, generation prompt added), else the plain text with the tokenizer's special
    tokens (e.g. BOS). Rendered to text first: `apply_chat_template(tokenize=True)` returns a
    list or a dict depending on the transformers version."""
    if getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text)["input_ids"])


def encode_messages(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """A conversation's prompt token ids through the tokenizer's chat template, the generation
    prompt added (the template's own special tokens, none added again)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
