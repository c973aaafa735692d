"""A tiny Hugging Face model folder built offline: a Qwen2 config (2 layers, hidden 64) and a
word-level tokenizer trained with `tokenizers` on generated text, with a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<user> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _corpus() -> list[str]:
    words = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(i) for i in range(100)]
    return ["Write " + w + " exactly " + str(i % 41) + " times ." for i, w in enumerate(words * 2)] + [" ".join(words)]


def make_tiny_hf_model(folder: Path, seed: int = 0, tie: bool = True) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<unk>", "<pad>", "<eos>", "<bos>", "<user>", "<assistant>", "<end>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_corpus(), trainers.WordLevelTrainer(special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def hf_run(engine: Any, folder: Path, name: str, steps: int, task: Any) -> tuple[int, dict[str, str]]:
    """A run of the repeat task in words for the model folder (B=2, N=2, η=1), its prompts
    enqueued (twice what `steps` consume), and a token per worker role."""
    from api.auth import create_token
    from staleflow_db.protocol import Prompt, Protocol
    from staleflow_db.types import RunConfig
    from workers.models.hf import load_tokenizer
    from workers.tasks.text import repeat_prompts

    prompts = repeat_prompts(load_tokenizer(folder), 4 * steps * 2, seed=0, prefix=name, task=task)
    protocol = Protocol(engine)
    run = protocol.create_run(
        name,
        RunConfig(
            batch_size=2,
            group_size=2,
            eta=1,
            max_response_tokens=task.max_response,
            max_prompt_tokens=max(len(t) for _, t, _ in prompts),
        ),
    )
    protocol.enqueue(run, [Prompt(k, t, m) for k, t, m in prompts])
    tokens = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward", "coordinator")}
    return run, tokens


def start_ps(cluster: Any, tmp_path: Path) -> str:
    """A parameter server in `cluster`; its HOST:PORT once it is ready."""
    ready = tmp_path / "ps.json"
    cluster.spawn("ps", ["ps", "--data-dir", str(tmp_path / "ps"), "--port", "0", "--ready-file", str(ready)])
    cluster.wait_file(ready, timeout=120)
    ps = json.loads(ready.read_text())
    return f"{ps['host']}:{ps['port']}"
