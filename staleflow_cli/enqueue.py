"""``staleflow enqueue RUN --data PATH``: prompts from a user's data set into a run.

The data: a JSON Lines or Parquet file, or a Hugging Face ``datasets`` folder (written by
``save_to_disk``, or data files ``load_dataset`` reads), streamed (`workers.tasks.data`). Each
row becomes a prompt (`workers.tasks.prompts`): a column (``--prompt-field``), a template over
columns (``--template "Solve: {question}"``) or a column of chat messages
(``--messages-field``); ``--answer-field`` goes to ``meta["answer"]`` for the verifier,
``--meta-field`` copies more columns into the metadata. Tokens: ``--tokenizer FOLDER`` (a Hugging
Face tokenizer, through its chat template when it has one or with ``--chat-template``), else
UTF-8 bytes.

Two passes over the data, in constant memory: the first checks every row against the options
and the run (prompt length, the API's schema, repeated keys) and spools the prompts to a
temporary file; a row that fails is refused by file and line or row, saying what to change.
Any refusal stops the command before anything is sent, unless ``--skip-invalid``: then every
skipped row is listed and the rest is enqueued. The second pass sends the spool in chunks.
Idempotent: every row has a client key (``--key-field``, else a hash of the row and its
prompt), and the API returns the existing group for a key it has seen, so re-running the
command enqueues nothing twice.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import typer
from pydantic import ValidationError
from rich.markup import escape

from staleflow_cli.common import API, TOKEN, connect, console, fail, progress
from workers.client import ApiError
from workers.extras import MissingExtra
from workers.tasks.data import FORMATS, DataError, Row, Source, open_data
from workers.tasks.prompts import Encoder, PromptSpec, RowProblem, SpecError
from workers.wire.models import PromptIn
from workers.wire.run_config import RunConfig

CHUNK = 500  # prompts per request ...
CHUNK_BYTES = 8 << 20  # ... and at most this much JSON, well under the API's body limit
SHOWN = 20  # refusals listed when the command stops (all are counted)


@dataclass
class Check:
    """What the first pass found."""

    limit: int  # the run's max_prompt_tokens
    ok: int = 0
    refused: int = 0
    shown: list[str] = field(default_factory=list)
    overlong: int = 0
    longest: int = 0
    keys: dict[int, int] = field(default_factory=dict)  # 64-bit digest of a key -> where (packed)
    files: dict[str, int] = field(default_factory=dict)


def _pack(check: Check, row: Row) -> int:
    return check.files.setdefault(f"{row.file}\0{row.unit}", len(check.files)) << 40 | row.number


def _unpack(check: Check, packed: int) -> str:
    name = next(n for n, i in check.files.items() if i == packed >> 40)
    file, unit = name.split("\0")
    return f"{file}: {unit} {packed & ((1 << 40) - 1)}"


def _prompt(row: Row, spec: PromptSpec, encode: Encoder, check: Check, extra: dict[str, Any]) -> PromptIn:
    """The row's prompt, or RowProblem saying what to change."""
    if row.record is None:
        raise RowProblem(row.problem or "unreadable")
    tokens = encode(spec.prompt(row.record))
    if not tokens:
        raise RowProblem("the prompt is 0 tokens")
    if len(tokens) > check.limit:
        check.overlong, check.longest = check.overlong + 1, max(check.longest, len(tokens))
        raise RowProblem(f"the prompt is {len(tokens)} tokens, over the run's max_prompt_tokens ({check.limit})")
    meta = {**spec.meta(row.record), **extra}
    key = spec.key(row.record, tokens, meta)
    try:  # the API's own schema (key length, metadata size): refused here, not halfway
        prompt = PromptIn(client_key=key, prompt_tokens=tokens, meta=meta)
    except ValidationError as e:
        raise RowProblem("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest())
    if digest in check.keys:
        raise RowProblem(
            f"key {key!r} already used by {_unpack(check, check.keys[digest])}: remove the repeated row, "
            "or name a column of unique ids with --key-field"
        )
    check.keys[digest] = _pack(check, row)
    return prompt


def _check(
    source: Source, spec: PromptSpec, encode: Encoder, limit: int, extra: dict[str, Any], skip: bool, spool: IO[str]
) -> Check:
    check = Check(limit)
    with progress(source.total, f"check {source.name}") as (bar, task):
        for row in source.rows():
            try:
                prompt = _prompt(row, spec, encode, check, extra)
            except RowProblem as e:
                check.refused += 1
                if skip:  # every skipped row is listed
                    console.print(f"[yellow]skipped[/yellow] {escape(f'{row.where}: {e}')}", highlight=False)
                elif len(check.shown) < SHOWN:
                    check.shown.append(f"{row.where}: {e}")
            else:
                spool.write(json.dumps([row.where, prompt.model_dump(mode="json")]) + "\n")
                check.ok += 1
            bar.advance(task)
    return check


def _overlong_advice(check: Check, skipped: bool) -> str:
    return (
        f"prompts longer than the run's max_prompt_tokens ({check.limit}): {check.overlong}, the longest "
        f"{check.longest} tokens. max_prompt_tokens is set when a run is created: enqueue into a run created "
        f"with max_prompt_tokens of at least {check.longest} (its config in `staleflow run create` or "
        "POST /v1/runs), or shorten the prompts (another --template)"
        + ("" if skipped else ", or pass --skip-invalid to leave them out")
    )


def _chunks(spool: IO[str]) -> Iterator[tuple[list[str], list[dict[str, Any]]]]:
    wheres: list[str] = []
    prompts: list[dict[str, Any]] = []
    size = 0
    for raw in spool:
        if prompts and (len(prompts) == CHUNK or size + len(raw) > CHUNK_BYTES):
            yield wheres, prompts
            wheres, prompts, size = [], [], 0
        where, prompt = json.loads(raw)
        wheres.append(where)
        prompts.append(prompt)
        size += len(raw)
    if prompts:
        yield wheres, prompts


def enqueue(
    run: str = typer.Argument(..., help="run id or name"),
    data: Path = typer.Option(
        ...,
        "--data",
        "--jsonl",
        help="the data set: a JSON Lines or Parquet file, or a Hugging Face datasets folder "
        "(save_to_disk, or data files load_dataset reads)",
    ),
    fmt: str | None = typer.Option(
        None, "--format", help=f"the data's format when its name does not tell: {', '.join(FORMATS)}"
    ),
    split: str | None = typer.Option(None, "--split", help="the split of a datasets folder that has several"),
    prompt_field: str | None = typer.Option(None, "--prompt-field", help="the column holding the prompt text"),
    template: str | None = typer.Option(
        None, "--template", help='the prompt from columns, Python format fields: "Solve: {question}"'
    ),
    messages_field: str | None = typer.Option(
        None, "--messages-field", help="a column of chat messages [{role, content}, ...] (needs --tokenizer)"
    ),
    answer_field: str | None = typer.Option(
        None, "--answer-field", help="the column holding the reference answer (meta['answer'], for --verifier math)"
    ),
    meta_field: list[str] | None = typer.Option(
        None, "--meta-field", help="a column copied into the prompt's metadata under its name (repeatable)"
    ),
    key_field: str | None = typer.Option(
        None, "--key-field", help="a column of unique ids, the client keys (default: a hash of the row and its prompt)"
    ),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        "--model",
        help="tokenize with this Hugging Face model or tokenizer folder (default: UTF-8 bytes)",
    ),
    chat_template: bool | None = typer.Option(
        None,
        "--chat-template/--no-chat-template",
        help="through the tokenizer's chat template (one user turn, generation prompt added); "
        "default: when the tokenizer has one",
    ),
    skip_invalid: bool = typer.Option(
        False, "--skip-invalid", help="enqueue the valid rows and list every refused one (default: refuse all)"
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
    """Enqueue prompts from a data set, idempotently (a trainer or coordinator token).

    Every row is checked first; a refused row (named by file and line) stops the command
    before anything is sent, unless --skip-invalid."""
    try:  # the options and the data first: refused before the API is even asked
        spec = PromptSpec(prompt_field, template, messages_field, answer_field, tuple(meta_field or ()), key_field)
        source = open_data(data, fmt, split)
        missing = spec.missing(source.columns) if source.columns is not None else []
        if missing:
            raise DataError(f"{source.name}: " + "; ".join(missing))
        encode = Encoder(tokenizer, chat_template, messages=messages_field is not None)
    except (SpecError, DataError, MissingExtra) as e:
        raise fail(f"{e}; nothing was enqueued") from None
    client, run_id = connect(api, token, run, wait_s=0)
    status = client.run_status(run_id)
    config, before = RunConfig(**status.config.model_dump()), sum(status.groups.values())
    extra: dict[str, Any] = (
        {"overlong": {"max": config.max_response_tokens, "buffer": overlong_buffer}} if overlong_buffer else {}
    )
    console.print(escape(f"{source.name}: {source.total} rows ({source.format}); tokens: {encode.description}"))
    with tempfile.TemporaryFile("w+", encoding="utf-8") as spool:
        try:
            check = _check(source, spec, encode, config.max_prompt_tokens, extra, skip_invalid, spool)
        except (OSError, DataError) as e:  # the data changed or vanished under us
            raise fail(f"cannot read {source.name}: {e}; nothing was enqueued") from None
        if check.refused and not skip_invalid:
            for line in check.shown:
                console.print(f"[red]refused[/red] {escape(line)}", highlight=False)
            more = check.refused - len(check.shown)
            if more:
                console.print(f"... and {more} more refused rows")
            if check.overlong:
                console.print(escape(_overlong_advice(check, skipped=False)), highlight=False)
            raise fail(
                f"{check.refused} of {check.refused + check.ok} rows refused (listed above); nothing was enqueued "
                "(fix them, or pass --skip-invalid to enqueue the others)"
            )
        if check.overlong:
            console.print(escape(_overlong_advice(check, skipped=True)), highlight=False)
        if not check.ok:
            raise fail(f"{source.name}: no row to enqueue; nothing was enqueued")
        spool.seek(0)
        with progress(check.ok, f"enqueue {source.name} into run {run_id}") as (bar, task):
            for wheres, prompts in _chunks(spool):
                try:
                    client.enqueue(run_id, prompts)
                except ApiError as e:  # earlier chunks stay enqueued: a re-run completes the data
                    raise fail(f"{wheres[0]} .. {wheres[-1]}: the API refused them: {e}") from None
                bar.advance(task, len(prompts))
    new = sum(client.run_status(run_id).groups.values()) - before
    skipped = f"; {check.refused} rows skipped (listed above)" if check.refused else ""
    console.print(
        escape(
            f"enqueued {check.ok} prompts from {source.name} into run {run_id} ({new} new, "
            f"{max(0, check.ok - new)} enqueued before){skipped}"
        )
    )
