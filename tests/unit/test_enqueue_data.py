"""The data sets `staleflow enqueue` reads (workers/tasks/data.py) and how a row becomes a
prompt (workers/tasks/prompts.py): every format gives the same rows, named by file and line or
row; every refusal names the column or option and what to change."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from workers.extras import MissingExtra
from workers.tasks.data import DataError, open_data, write_parquet
from workers.tasks.prompts import Encoder, PromptSpec, RowProblem, SpecError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

RECORDS = [{"question": f"{i} + 1", "answer": i + 1, "level": i % 3} for i in range(2500)]  # > one batch


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _parquet(path: Path, records: list[dict], row_group_size: int = 1000) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def _rows(source) -> list:
    return list(source.rows())


def test_every_format_gives_the_same_rows(tmp_path):
    ds = datasets.Dataset.from_list(RECORDS)
    ds.with_format("numpy").save_to_disk(tmp_path / "saved")  # read back as plain values all the same
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(tmp_path / "dict")
    (tmp_path / "folder" / "data").mkdir(parents=True)
    _parquet(tmp_path / "folder" / "data" / "train-00000-of-00002.parquet", RECORDS[:1000])
    _parquet(tmp_path / "folder" / "data" / "train-00001-of-00002.parquet", RECORDS[1000:])
    _parquet(tmp_path / "folder" / "data" / "test-00000-of-00001.parquet", RECORDS[:2])
    (tmp_path / "jfolder").mkdir()
    _jsonl(tmp_path / "jfolder" / "train.jsonl", RECORDS)
    assert write_parquet(tmp_path / "w.parquet", iter(RECORDS)) == len(RECORDS)
    assert pq.ParquetFile(tmp_path / "w.parquet").num_row_groups == 3  # written batch by batch
    cases = [
        (_jsonl(tmp_path / "d.jsonl", RECORDS), None, "jsonl", None),
        (_parquet(tmp_path / "d.parquet", RECORDS), None, "parquet", ("answer", "level", "question")),
        (tmp_path / "w.parquet", None, "parquet", ("answer", "level", "question")),
        (tmp_path / "saved", None, "saved", ("question", "answer", "level")),
        (tmp_path / "dict", "train", "saved", ("question", "answer", "level")),
        (tmp_path / "folder", "train", "folder", ("answer", "level", "question")),
        (tmp_path / "jfolder", None, "folder", None),
    ]
    for path, split, fmt, columns in cases:
        source = open_data(path, split=split)
        assert (source.format, source.total) == (fmt, len(RECORDS)), path
        assert source.columns is None or sorted(source.columns) == sorted(columns), path
        rows = _rows(source)
        assert [r.record for r in rows] == RECORDS, path
        assert _rows(source)[-1].record == RECORDS[-1]  # a second pass starts over
    # rows are named by their file: the folder's second file counts from 1 again
    rows = _rows(open_data(tmp_path / "folder", split="train"))
    assert rows[1000].where.endswith("train-00001-of-00002.parquet: row 1")
    assert _rows(open_data(tmp_path / "d.jsonl"))[4].where == f"{tmp_path / 'd.jsonl'}: line 5"


def test_unreadable_data_is_refused_with_what_to_change(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "csvs").mkdir()
    (tmp_path / "csvs" / "train.csv").write_text("a,b\n1,2\n")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:2])}).save_to_disk(tmp_path / "one")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS[:2]), "test": datasets.Dataset.from_list(RECORDS[:2])}
    ).save_to_disk(tmp_path / "two")
    (tmp_path / "bad.parquet").write_text("not parquet")
    cases = [
        (tmp_path / "x.csv", {}, "pass --format jsonl or --format parquet"),
        (tmp_path / "nope.jsonl", {}, "does not exist"),
        (tmp_path / "csvs", {}, "holds csv data files; enqueue reads JSON Lines and Parquet"),
        (tmp_path / "two", {}, "holds the splits train, test: pass --split"),
        (tmp_path / "two", {"split": "validation"}, "has no split 'validation' (splits: train, test)"),
        (tmp_path / "bad.parquet", {}, "is not a readable Parquet file"),
        (tmp_path / "x.csv", {"fmt": "xml"}, "unknown format 'xml'"),
        (tmp_path / "x.csv", {"fmt": "jsonl", "split": "train"}, "--split applies to datasets folders"),
    ]
    for path, kw, needle in cases:
        with pytest.raises(DataError, match=None) as e:
            open_data(path, **kw)
        assert needle in str(e.value), (needle, str(e.value))
    assert open_data(tmp_path / "one").total == 2  # one split: no --split needed


def test_a_bad_jsonl_line_is_a_row_with_a_problem(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"q": 1}\n\n{"q": \n[1]\n[\n\xff\n{"q": 2}\n')
    rows = _rows(open_data(path))
    assert [(r.number, r.record, (r.problem or "")[:22]) for r in rows] == [
        (1, {"q": 1}, ""),
        (3, None, "not valid JSON (Expect"),
        (4, None, "expected a JSON object"),
        (5, None, "not valid JSON (Expect"),
        (6, None, "not UTF-8 text (invali"),
        (7, {"q": 2}, ""),
    ]
    path.write_text('[{"q": 1}, {"q": 2}]\n')  # a JSON array file: named as such
    assert "(a JSON array? write JSON Lines: one object a line)" in (_rows(open_data(path))[0].problem or "")


class _NotInstalled:
    """A meta-path finder for which pyarrow and datasets are not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("pyarrow", "datasets"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name.partition(".")[0])


def test_a_missing_data_extra_names_it(monkeypatch, tmp_path):
    _parquet(tmp_path / "d.parquet", RECORDS[:3])
    (tmp_path / "saved").mkdir()
    for name in [m for m in sys.modules if m.partition(".")[0] in ("pyarrow", "datasets")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NotInstalled(), *sys.meta_path])
    for path in (tmp_path / "d.parquet", tmp_path / "saved"):
        with pytest.raises(MissingExtra, match=r"pip install 'staleflow\[data\]'"):
            open_data(path)
    _jsonl(tmp_path / "d.jsonl", RECORDS[:3])
    assert open_data(tmp_path / "d.jsonl").total == 3  # JSON Lines needs no extra


def test_prompts_from_a_field_a_template_or_messages():
    record = {
        "question": "2 + 2",
        "answer": 4,
        "id": "a",
        "tests": [1, 2],
        "messages": [{"role": "user", "content": "hi"}],
    }
    spec = PromptSpec(template="Solve: {question}. {{boxed}}", answer_field="answer", meta_fields=("tests",))
    assert spec.prompt(record) == "Solve: 2 + 2. {boxed}"
    assert spec.meta(record) == {"answer": "4", "tests": [1, 2]}
    assert PromptSpec(prompt_field="question").prompt(record) == "2 + 2"
    assert PromptSpec(messages_field="messages").prompt(record) == [{"role": "user", "content": "hi"}]
    # keys: a column, or a hash of the row and its prompt (another template: other groups)
    assert PromptSpec(prompt_field="question", key_field="id").key(record, [1], {}) == "a"
    k1, k2 = (spec.key(dict(reversed(record.items())), t, {}) for t in ([1], [2]))
    assert k1.startswith("row-") and k1 != k2 and k1 == spec.key(record, [1], {})
    # the columns a spec reads, checked once for a columnar data set
    assert spec.missing(["question", "answer"]) == [
        "no column 'tests' (named by --meta-field; columns: answer, question)"
    ]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (dict(), "give exactly one of --prompt-field, --template, --messages-field (got 0)"),
        (dict(prompt_field="q", template="{q}"), "(got 2)"),
        (dict(template="Solve: {}"), "name a column"),
        (dict(template="Solve: {q[0]}"), "name a column"),
        (dict(template="Solve: {q"), "write a literal brace as {{ or }}"),
        (dict(template="Solve!"), "names no column"),
        (dict(prompt_field="q", answer_field="a", meta_fields=("answer",)), "--meta-field answer would overwrite"),
    ],
)
def test_options_that_cannot_work_are_refused(spec, needle):
    with pytest.raises(SpecError) as e:
        PromptSpec(**spec)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("spec", "record", "needle"),
    [
        (dict(prompt_field="q"), {"p": "x", "a": 1}, "no prompt field 'q' (columns: a, p); change --prompt-field"),
        (dict(prompt_field="q"), {"q": None}, "prompt field 'q' is null"),
        (dict(prompt_field="q"), {"q": " "}, "prompt field 'q' is empty"),
        (dict(prompt_field="q"), {"q": ["x"]}, "prompt field 'q' must be a string or a number, got list"),
        (dict(prompt_field="q", answer_field="a"), {"q": "x", "a": True}, "answer field 'a' must be a string"),
        (dict(prompt_field="q", answer_field="a"), {"q": "x", "a": float("nan")}, "answer field 'a' is nan"),
        (dict(template="{q} {r}"), {"q": "x"}, "no field 'r' for --template (columns: q)"),
        (dict(template="{q}"), {"q": {"x": 1}}, "--template field 'q' must be a string or a number, got dict"),
        (dict(template="{q:d}"), {"q": "x"}, "Unknown format code 'd'"),
        (dict(messages_field="m"), {"m": "hi"}, "must be a non-empty list of {role, content} messages, got str"),
        (dict(messages_field="m"), {"m": [{"role": "user"}]}, "message 1 is not a {role, content} pair"),
        (dict(prompt_field="q", meta_fields=("t",)), {"q": "x", "t": b"\x00"}, "holds a bytes, not a JSON value"),
        (dict(prompt_field="q", meta_fields=("t",)), {"q": "x"}, "no meta field 't' (columns: q)"),
    ],
)
def test_a_row_that_cannot_be_a_prompt_says_why(spec, record, needle):
    s = PromptSpec(**spec)
    with pytest.raises(RowProblem) as e:
        s.prompt(record)
        s.meta(record)
    assert needle in str(e.value)


def test_bytes_encoder_and_its_refusals(tmp_path):
    assert Encoder()("hé") == list("hé".encode())
    with pytest.raises(SpecError, match="not a Hugging Face tokenizer or model folder"):
        Encoder(tmp_path)
    with pytest.raises(SpecError, match="--chat-template needs --tokenizer FOLDER"):
        Encoder(chat=True)
    with pytest.raises(SpecError, match="--messages-field needs --tokenizer FOLDER"):
        Encoder(messages=True)


def test_tokenizer_and_chat_template(tmp_path):
    pytest.importorskip("transformers")
    from hf_helpers import make_tiny_hf_model

    from workers.models.hf import load_tokenizer

    folder = make_tiny_hf_model(tmp_path / "model")
    tok = load_tokenizer(folder)
    chat = Encoder(folder, chat=None)
    assert chat.chat  # the tokenizer has one: used by default
    expect = tok("<user> Write a exactly 3 times . <end> <assistant>", add_special_tokens=False)["input_ids"]
    assert chat("Write a exactly 3 times .") == expect
    messages = [{"role": "system", "content": "Write a"}, {"role": "user", "content": "exactly 3 times ."}]
    two = tok("<user> Write a <end> <user> exactly 3 times . <end> <assistant>", add_special_tokens=False)
    assert chat(messages) == two["input_ids"]
    plain = Encoder(folder, chat=False)
    assert plain("Write a") == tok("Write a")["input_ids"]
    with pytest.raises(SpecError, match="drop --no-chat-template"):
        Encoder(folder, chat=False, messages=True)
    # a tokenizer without a chat template refuses --chat-template, naming the way out
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for f in folder.glob("chat_template.*"):
        f.unlink()
    assert not Encoder(folder).chat
    with pytest.raises(SpecError, match="has no chat template .* use --no-chat-template"):
        Encoder(folder, chat=True)
