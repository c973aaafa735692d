"""``staleflow enqueue RUN --jsonl FILE``: prompts from a JSONL data set into a run.

Each line is a JSON object; ``--prompt-field`` holds the prompt text, ``--answer-field`` the
reference answer (stored as ``meta["answer"]`` for the ``math`` verifier). Idempotent: every
line gets a client key -- its ``--key-field`` value, else a hash of the line's content -- and
the API returns the existing group for a key it has seen, so re-running the command (after
a crash halfway, or by mistake) enqueues nothing twice. The whole file is read and checked
first: a bad line fails the command, naming the line, before anything is sent.

Tokenization: ``--model FOLDER`` uses that Hugging Face tokenizer (through its chat template,
as `staleflow demo --model` does); without it, prompts are UTF-8 bytes (ids 0..255), which the
reward worker's default detokenizer reads back.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from staleflow_cli.common import API, TOKEN, connect, console, fail, hf_folder, progress
from workers.client import ApiError
from workers.wire.models import PromptIn
from workers.wire.run_config import RunConfig

CHUNK = 500  # prompts per request: well under the API's body limit for typical prompts


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as an editor shows it
    key: str
    prompt: str
    meta: dict[str, Any]


class BadLine(ValueError):
    def __init__(self, number: int, message: str):
        super().__init__(f"line {number}: {message}")


def _text(value: Any, number: int, field: str, what: str) -> str:
    # bool is an int in Python; a true/false answer is almost surely a mistaken field
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise BadLine(number, f"{what} field {field!r} must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadLine(number, f"{what} field {field!r} is {value}")
    text = str(value)
    if not text.strip():
        raise BadLine(number, f"{what} field {field!r} is empty")
    return text


def read_lines(path: Path, prompt_field: str, answer_field: str, key_field: str | None) -> list[Line]:
    """Parse and check every line (blank lines are skipped); raises BadLine on the first bad one."""
    out: list[Line] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                raise BadLine(number, f"not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise BadLine(number, f"expected a JSON object, got {type(obj).__name__}")
            for field, what in ((prompt_field, "prompt"), (answer_field, "answer"), (key_field, "key")):
                if field is not None and field not in obj:
                    raise BadLine(number, f"no {what} field {field!r} (fields: {', '.join(sorted(obj)) or 'none'})")
            prompt = _text(obj[prompt_field], number, prompt_field, "prompt")
            answer = _text(obj[answer_field], number, answer_field, "answer")
            if key_field is not None:
                key = _text(obj[key_field], number, key_field, "key")
            else:  # canonical JSON: re-formatting the file keeps the keys
                digest = hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
                key = f"jsonl-{digest[:32]}"
            if key in seen:
                raise BadLine(number, f"key {key!r} already used on line {seen[key]}")
            seen[key] = number
            out.append(Line(number, key, prompt, {"answer": answer}))
    return out


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _tokenizer(model: Path | None) -> Callable[[str], list[int]]:
    if model is None:
        return byte_tokens
    hf_folder(model)
    from workers.models.hf import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(model)
    return lambda text: encode_prompt(tokenizer, text)


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def enqueue(
    run: str = typer.Argument(..., help="run id or name"),
    jsonl: Path = typer.Option(
        ..., "--jsonl", exists=True, dir_okay=False, help="the data set: one JSON object a line"
    ),
    prompt_field: str = typer.Option(..., "--prompt-field", help="the field holding the prompt text"),
    answer_field: str = typer.Option(..., "--answer-field", help="the field holding the reference answer"),
    key_field: str | None = typer.Option(
        None, "--key-field", help="a unique id per line (default: a hash of the line's content)"
    ),
    model: Path | None = typer.Option(
        None, "--model", help="tokenize with this Hugging Face model folder (default: UTF-8 bytes)"
    ),
    overlong_buffer: int = typer.Option(
        0,
        "--overlong-buffer",
        min=0,
        help="DAPO's L_cache for the math verifier: penalise the last N tokens before the run's "
        "max_response_tokens (0: no penalty)",
    ),
    api: list[str] | None = API,
    token: str | None = TOKEN,
) -> None:
    """Enqueue prompts from a JSONL file, idempotently (a trainer or coordinator token)."""
    try:  # the file first: a bad line fails before the API is even asked
        lines = read_lines(jsonl, prompt_field, answer_field, key_field)
    except BadLine as e:
        raise fail(f"{jsonl}: {e}; nothing was enqueued") from None
    except (OSError, UnicodeDecodeError) as e:
        raise fail(f"cannot read {jsonl}: {e}") from None
    encode = _tokenizer(model)
    client, run_id = connect(api, token, run, wait_s=0)
    status = client.run_status(run_id)
    config, before = RunConfig(**status.config.model_dump()), sum(status.groups.values())
    extra: dict[str, Any] = (
        {"overlong": {"max": config.max_response_tokens, "buffer": overlong_buffer}} if overlong_buffer else {}
    )
    prompts: list[tuple[int, PromptIn]] = []
    for line in lines:
        tokens = encode(line.prompt)
        if not 0 < len(tokens) <= config.max_prompt_tokens:
            raise fail(
                f"{jsonl}: line {line.number}: the prompt is {len(tokens)} tokens, the run takes 1.."
                f"{config.max_prompt_tokens} (max_prompt_tokens); nothing was enqueued"
            )
        try:  # the API's own schema (key length, metadata size): refused here, not halfway
            prompt = PromptIn(client_key=line.key, prompt_tokens=tokens, meta={**line.meta, **extra})
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise fail(f"{jsonl}: line {line.number}: {problems}; nothing was enqueued") from None
        prompts.append((line.number, prompt))
    with progress(len(prompts), f"enqueue {jsonl.name} into run {run_id}") as (bar, task):
        for chunk in _chunks(prompts, CHUNK):
            try:
                client.enqueue(run_id, [p for _, p in chunk])
            except ApiError as e:  # earlier chunks stay enqueued: a re-run completes the file
                raise fail(f"{jsonl}: lines {chunk[0][0]}..{chunk[-1][0]}: the API refused them: {e}") from None
            bar.advance(task, len(chunk))
    new = sum(client.run_status(run_id).groups.values()) - before
    console.print(
        f"enqueued {len(prompts)} prompts from {jsonl} into run {run_id} ({new} new, {max(0, len(prompts) - new)} enqueued before)"
    )
