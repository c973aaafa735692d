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


def hf_run(
    engine: Any, folder: Path, name: str, steps: int, task: Any, batch_size: int = 2, group_size: int = 2
) -> tuple[int, dict[str, str]]:
    """A run of the repeat task in words for the model folder (B=2, N=2, η=1 by default), its
    prompts enqueued (twice what `steps` consume), and a token per worker role."""
    from api.auth import create_token
    from staleflow_db.protocol import Prompt, Protocol
    from staleflow_db.types import RunConfig
    from workers.models.hf import load_tokenizer
    from workers.tasks.text import repeat_prompts

    prompts = repeat_prompts(load_tokenizer(folder), 2 * batch_size * steps * 2, seed=0, prefix=name, task=task)
    protocol = Protocol(engine)
    run = protocol.create_run(
        name,
        RunConfig(
            batch_size=batch_size,
            group_size=group_size,
            eta=1,
            max_response_tokens=task.max_response,
            max_prompt_tokens=max(len(t) for _, t, _ in prompts),
        ),
    )
    protocol.enqueue(run, [Prompt(k, t, m) for k, t, m in prompts])
    tokens = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward", "coordinator")}
    return run, tokens


def start_ps(cluster: Any, tmp_path: Path, run: int, trainer_token: str) -> str:
    """`run`'s parameter server in `cluster` (it fetches the run's keys with the trainer
    token); its HOST:PORT once it is ready."""
    ready = tmp_path / "ps.json"
    cluster.spawn(
        "ps",
        ["ps", "--run", str(run), "--data-dir", str(tmp_path / "ps"), "--port", "0", "--ready-file", str(ready)],
        env={"STALEFLOW_TOKEN": trainer_token},
    )
    cluster.wait_file(ready, timeout=120)
    ps = json.loads(ready.read_text())
    return f"{ps['host']}:{ps['port']}"


def spawn_hf_workers(
    cluster: Any, run: int, folder: Path, ps_addr: str, tokens: dict[str, str], rollout_args: list[str] | None = None
) -> None:
    """Everything but the trainer in `cluster`: a reward worker (repeat verifier), an `hf`
    rollout worker on the model folder pulling from the PS (plus `rollout_args`), and the
    coordinator."""
    common = ["--run", str(run)]
    cluster.spawn(
        "reward", ["reward-worker", *common, "--verifier", "repeat"], env={"STALEFLOW_TOKEN": tokens["reward"]}
    )
    cluster.spawn(
        "rollout",
        ["rollout-worker", *common, "--engine", "hf", "--model", str(folder), "--ps", ps_addr]
        + ["--kv-capacity", "1024", "--heartbeat", "0.5", *(rollout_args or [])],
        env={"STALEFLOW_TOKEN": tokens["rollout"]},
    )
    cluster.spawn(
        "coordinator", ["coordinator", *common, "--lease", "3"], env={"STALEFLOW_TOKEN": tokens["coordinator"]}
    )


def train_hf_run(
    db_url: str, engine: Any, work: Path, steps: int, task: Any, device: str, engine_flags: list[str]
) -> tuple[int, Path, Path]:
    """A tiny model folder's run trained for `steps` versions end to end in real processes: the
    API, the parameter server, `trainer --model --device`, and `spawn_hf_workers` with
    `engine_flags` (the rollout worker's engine arguments). Returns the run, the model folder
    and the trainer's checkpoint folder. The e2e test runs it on the CPU, bench/gpu_check.py
    on a GPU."""
    from staleflow_cli.launch import Cluster, ProcessDied, wait_until
    from staleflow_db.protocol import Protocol

    folder = make_tiny_hf_model(work / "model")
    run, tokens = hf_run(engine, folder, "hf", steps, task)
    status = Protocol(engine).reads.status
    checkpoint = work / "checkpoint"
    with Cluster(work, db_url) as cluster:
        cluster.start_api(timeout=120)
        ps_addr = start_ps(cluster, work, run, tokens["trainer"])
        cluster.spawn(
            "trainer",
            ["trainer", "--run", str(run), "--ps", ps_addr, "--model", str(folder), "--device", device]
            + ["--checkpoint-dir", str(checkpoint), "--steps", str(steps), "--lr", "1e-3"],
            env={"STALEFLOW_TOKEN": tokens["trainer"]},
        )
        spawn_hf_workers(cluster, run, folder, ps_addr, tokens, engine_flags)

        def trained() -> bool:
            try:
                cluster.check()
            except ProcessDied:
                # the trainer exits 0 once it has published `steps` versions, maybe within this poll
                if status(run)["version"] >= steps:
                    return True
                raise
            return status(run)["version"] >= steps

        wait_until(trained, 400, 1.0, lambda: f"run at version {status(run)['version']} of {steps}")
    return run, folder, checkpoint


def assert_trained_hf_run(engine: Any, run: int, folder: Path, steps: int) -> None:
    """Versions 1..steps published, each with new weights; the engine generated with a
    published version; the audit is clean and counts `steps` steps."""
    from sqlalchemy import text

    from staleflow_db.audit import summary
    from workers.models.hf import load_model
    from workers.trainer.param_store import state_dict_checksum

    with engine.connect() as c:
        checksums = dict(
            c.execute(text("SELECT version, checksum FROM param_versions WHERE run_id = :r"), {"r": run}).all()
        )
        generated = c.execute(text("SELECT max(version) FROM segments WHERE run_id = :r"), {"r": run}).scalar()
    initial = state_dict_checksum(load_model(folder).state_dict())
    assert set(checksums) == set(range(1, steps + 1))
    assert len({initial, *checksums.values()}) == steps + 1  # every step changed the weights
    assert generated is not None and generated >= 1  # the engine pulled published versions
    audit = summary(engine, run)
    assert audit["violations"] == []
    assert len(audit["steps"]) == steps
