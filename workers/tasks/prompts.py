"""From a data set's row (a dict of columns, `workers.tasks.data`) to a prompt: its text (a
column, or a template over columns) or a conversation (a column of chat messages), the
metadata the verifier reads (``meta["answer"]`` and any columns asked for), and a client key.
`Encoder` turns the text or conversation into token ids: UTF-8 bytes, or a Hugging Face
tokenizer, through its chat template or not.

Every refusal is a `RowProblem` (one row) or a `SpecError` (the options), and says what to
change.
"""

from __future__ import annotations

import hashlib
import json
import math
import string
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from workers.extras import missing_extra

Prompt = str | list[dict[str, Any]]  # a text, or chat messages


class SpecError(ValueError):
    """The options cannot work (for any row): the message names the option to change."""


class RowProblem(ValueError):
    """One row cannot become a prompt; the message names the column and what is wrong."""


def _columns(record: dict[str, Any]) -> str:
    return ", ".join(sorted(map(str, record))) or "none"


def _text(record: dict[str, Any], column: str, what: str, option: str) -> str:
    if column not in record:
        raise RowProblem(f"no {what} field {column!r} (columns: {_columns(record)}); change {option}")
    value = record[column]
    if value is None:
        raise RowProblem(f"{what} field {column!r} is null")
    # bool is an int in Python; a true/false answer is almost surely a mistaken field
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise RowProblem(f"{what} field {column!r} must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RowProblem(f"{what} field {column!r} is {value}")
    text = str(value)
    if not text.strip():
        raise RowProblem(f"{what} field {column!r} is empty")
    return text


def _messages(record: dict[str, Any], column: str) -> list[dict[str, Any]]:
    if column not in record:
        raise RowProblem(f"no messages field {column!r} (columns: {_columns(record)}); change --messages-field")
    value = record[column]
    shape = "a non-empty list of {role, content} messages"
    if not isinstance(value, list) or not value:
        raise RowProblem(f"messages field {column!r} must be {shape}, got {type(value).__name__}")
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowProblem(f"messages field {column!r}: message {i} is not a {{role, content}} pair of strings")
    if not any(m["content"].strip() for m in value):
        raise RowProblem(f"messages field {column!r}: every message is empty")
    return [{"role": m["role"], "content": m["content"]} for m in value]


@dataclass(frozen=True)
class PromptSpec:
    """Which columns make a prompt: exactly one of `prompt_field` (the text), `template`
    (Python format fields naming columns: ``"Solve: {question}"``) and `messages_field`
    (chat messages); `answer_field` goes to ``meta["answer"]``, each of `meta_fields` to
    ``meta[column]``; `key_field` is the client key (default: a hash of the row and its prompt)."""

    prompt_field: str | None = None
    template: str | None = None
    messages_field: str | None = None
    answer_field: str | None = None
    meta_fields: tuple[str, ...] = ()
    key_field: str | None = None

    def __post_init__(self) -> None:
        given = [o for o, v in self._sources() if v is not None]
        if len(given) != 1:
            raise SpecError(f"give exactly one of --prompt-field, --template, --messages-field (got {len(given)})")
        if self.answer_field is not None and "answer" in self.meta_fields:
            raise SpecError("--meta-field answer would overwrite --answer-field's meta['answer']: drop one")
        if self.template is not None:
            _ = self.template_fields  # refuse a malformed template now

    def _sources(self) -> list[tuple[str, str | None]]:
        return [
            ("--prompt-field", self.prompt_field),
            ("--template", self.template),
            ("--messages-field", self.messages_field),
        ]

    @cached_property
    def template_fields(self) -> tuple[str, ...]:
        """The columns the template names (parsed once)."""
        assert self.template is not None
        try:
            parsed = list(string.Formatter().parse(self.template))
        except ValueError as e:
            raise SpecError(f"--template {self.template!r}: {e} (write a literal brace as {{{{ or }}}})") from None
        fields = [f for _, f, _, _ in parsed if f is not None]
        for f in fields:  # "{0}", "{}", "{a.b}", "{a[0]}": not a column's name
            if not f or f.isdigit() or any(c in f for c in ".["):
                raise SpecError(f"--template field {{{f}}}: name a column ({{question}}), no positions or indexing")
        if not fields:
            raise SpecError(f"--template {self.template!r} names no column: write {{column}} where it goes")
        return tuple(fields)

    def missing(self, columns: Iterable[str]) -> list[str]:
        """What a data set with these columns (every row has them) lacks, as refusals."""
        have = set(columns)
        out = []
        for option, column in self.named():
            if column not in have:
                out.append(f"no column {column!r} (named by {option}; columns: {', '.join(sorted(have)) or 'none'})")
        return out

    def named(self) -> list[tuple[str, str]]:
        """Every column this spec reads, with the option that names it."""
        named = [(o, c) for o, c in self._sources() if c is not None and o != "--template"]
        if self.template is not None:
            named += [("--template", f) for f in dict.fromkeys(self.template_fields)]
        named += [(o, c) for o, c in (("--answer-field", self.answer_field), ("--key-field", self.key_field)) if c]
        return named + [("--meta-field", c) for c in self.meta_fields]

    def prompt(self, record: dict[str, Any]) -> Prompt:
        if self.prompt_field is not None:
            return _text(record, self.prompt_field, "prompt", "--prompt-field")
        if self.messages_field is not None:
            return _messages(record, self.messages_field)
        values = {}
        for f in self.template_fields:
            if f not in record:
                raise RowProblem(f"no field {f!r} for --template (columns: {_columns(record)})")
            value = record[f]
            if value is None or isinstance(value, bool) or not isinstance(value, str | int | float):
                kind = "null" if value is None else type(value).__name__
                raise RowProblem(f"--template field {f!r} must be a string or a number, got {kind}")
            values[f] = value
        assert self.template is not None
        try:
            text = self.template.format_map(values)
        except (ValueError, TypeError) as e:  # a format spec that does not fit the value
            raise RowProblem(f"--template {self.template!r}: {e}") from None
        if not text.strip():
            raise RowProblem("the template gives an empty prompt")
        return text

    def meta(self, record: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if self.answer_field is not None:
            meta["answer"] = _text(record, self.answer_field, "answer", "--answer-field")
        for column in self.meta_fields:
            if column not in record:
                raise RowProblem(f"no meta field {column!r} (columns: {_columns(record)}); change --meta-field")
            try:
                json.dumps(record[column], allow_nan=False)
            except (TypeError, ValueError):
                raise RowProblem(
                    f"meta field {column!r} holds a {type(record[column]).__name__}, not a JSON value"
                ) from None
            meta[column] = record[column]
        return meta

    def key(self, record: dict[str, Any], tokens: list[int], meta: dict[str, Any]) -> str:
        if self.key_field is not None:
            return _text(record, self.key_field, "key", "--key-field")
        # canonical JSON: re-formatting or re-ordering the file keeps the keys; the prompt's
        # tokens count too, so another template or tokenizer makes other groups
        canonical = json.dumps([record, tokens, meta], sort_keys=True, ensure_ascii=False, default=repr)
        return f"row-{hashlib.sha256(canonical.encode()).hexdigest()[:32]}"


class Encoder:
    """Token ids of a prompt: UTF-8 bytes (ids 0..255, what the reward worker's default
    detokenizer reads) without a tokenizer; else the tokenizer's, through its chat template
    (one user turn for a text, the generation prompt added) when `chat` is True, or when it
    is None and the tokenizer has one -- as `staleflow demo --model` words its prompts."""

    def __init__(self, tokenizer: Path | None = None, chat: bool | None = None, messages: bool = False):
        self.tokenizer: Any = None
        self.chat = False
        if tokenizer is None:
            if chat or messages:
                need = "--chat-template" if chat else "--messages-field"
                raise SpecError(f"{need} needs --tokenizer FOLDER (a Hugging Face tokenizer with a chat template)")
            self.description = "UTF-8 bytes"
            return
        if not any((tokenizer / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")):
            raise SpecError(
                f"--tokenizer {tokenizer}: not a Hugging Face tokenizer or model folder "
                "(no tokenizer_config.json or tokenizer.json)"
            )
        try:
            from workers.models.hf import load_tokenizer
        except ModuleNotFoundError as e:  # torch or transformers: name the extra
            raise (missing_extra(e) or e) from None
        self.tokenizer = load_tokenizer(tokenizer)
        has = bool(getattr(self.tokenizer, "chat_template", None))
        if (chat or messages) and not has:
            need = "--chat-template" if chat else "--messages-field"
            raise SpecError(
                f"{need}: the tokenizer at {tokenizer} has no chat template (tokenizer_config.json's "
                "chat_template); use --no-chat-template with --prompt-field or --template"
            )
        if messages and chat is False:
            raise SpecError("--messages-field goes through the chat template: drop --no-chat-template")
        self.chat = has if chat is None else chat
        self.description = f"the tokenizer at {tokenizer}" + (", chat template" if self.chat else "")

    def __call__(self, prompt: Prompt) -> list[int]:
        if self.tokenizer is None:
            assert isinstance(prompt, str)
            return list(prompt.encode("utf-8"))
        from workers.models.hf import encode_messages

        if isinstance(prompt, list):
            messages = prompt
        elif self.chat:
            messages = [{"role": "user", "content": prompt}]
        else:
            return list(self.tokenizer(prompt)["input_ids"])
        try:
            return encode_messages(self.tokenizer, messages)
        except Exception as e:  # the template's own checks (jinja's TemplateError: roles must alternate, ...)
            raise RowProblem(f"the chat template refused the messages: {e}") from None
