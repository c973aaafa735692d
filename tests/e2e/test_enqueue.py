"""`staleflow dataset arithmetic` and `staleflow enqueue` against a real API and database:
JSON Lines, Parquet and datasets folders give the same groups; the answer and other columns
land in each prompt's metadata; a template or a chat template makes the prompt; a second run
enqueues nothing new; every bad row is listed by file and line before anything is sent (or,
with --skip-invalid, listed and left out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from api_helpers import REPO, ApiServer, token
from sqlalchemy import text

from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig

N = 40


def staleflow(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("STALEFLOW_TOKEN", "STALEFLOW_API_URL")}
    return subprocess.run(
        [sys.executable, "-m", "staleflow_cli.main", *args],
        cwd=REPO,
        env={**clean, "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _groups(engine, run: int) -> list[tuple[str, dict]]:
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT client_key, meta FROM prompt_groups WHERE run_id = :r ORDER BY id"), {"r": run}
        ).all()
    return [(k, m) for k, m in rows]


@pytest.fixture
def served_run(db_url, engine):
    run = Protocol(engine).create_run("data", RunConfig(batch_size=2, group_size=2, eta=1, max_response_tokens=64))
    with ApiServer(db_url) as api:
        yield run, {"STALEFLOW_API_URL": api.url, "STALEFLOW_TOKEN": token(db_url, "trainer", run)}


def test_enqueue_is_idempotent_and_stores_the_answer(served_run, engine, tmp_path):
    run, env = served_run
    data = tmp_path / "arith.jsonl"
    out = staleflow("dataset", "arithmetic", "--n", str(N), "--seed", "1", "--out", str(data))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in data.read_text().splitlines()]
    args = ["enqueue", str(run), "--jsonl", str(data), "--prompt-field", "prompt", "--answer-field", "answer"]
    for attempt in range(2):
        out = staleflow(*args, "--key-field", "id", "--overlong-buffer", "16", **env)
        assert out.returncode == 0, out.stdout + out.stderr
        new = N if attempt == 0 else 0
        assert f"({new} new, {N - new} enqueued before)" in " ".join(out.stderr.split())
        groups = _groups(engine, run)
        assert len(groups) == N  # the second run enqueued nothing
    assert [k for k, _ in groups] == [x["id"] for x in lines]
    assert groups[0][1] == {"answer": lines[0]["answer"], "overlong": {"max": 64, "buffer": 16}}
    with engine.connect() as c:
        prompt = c.execute(text("SELECT prompt_tokens FROM prompt_groups WHERE client_key = :k"), {"k": lines[0]["id"]})
        assert bytes(prompt.scalar()).decode() == lines[0]["prompt"]  # the byte tokenizer

    # the same problems written as Parquet: the same keys, nothing new
    parquet = tmp_path / "arith.parquet"
    assert staleflow("dataset", "arithmetic", "--n", str(N), "--seed", "1", "--out", str(parquet)).returncode == 0
    out = staleflow(*args[:2], "--data", str(parquet), *args[4:], "--key-field", "id", "--overlong-buffer", "16", **env)
    assert out.returncode == 0 and f"(0 new, {N} enqueued before)" in " ".join(out.stderr.split()), out.stderr

    # without --key-field: keys are content hashes, stable across runs and formatting
    reformatted = tmp_path / "spaced.jsonl"
    reformatted.write_text("\n".join(json.dumps(x, indent=None, separators=(" , ", " : ")) for x in lines[:5]) + "\n\n")
    for path in (data, reformatted):
        out = staleflow(*args[:2], "--jsonl", str(path), *args[4:], **env)
        assert out.returncode == 0, out.stdout + out.stderr
    assert len(_groups(engine, run)) == 2 * N  # N id-keyed + N hash-keyed (the 5 re-formatted: known)


BAD_LINES = [
    ('{"prompt": "2+2", "answer": true}', "line 3: answer field 'answer' must be a string or a number, got bool"),
    ('{"prompt": "2+2"}', "line 3: no answer field 'answer'"),
    ('{"prompt": ["2+2"], "answer": "4"}', "line 3: prompt field 'prompt' must be a string or a number, got list"),
    ('{"prompt": " ", "answer": "4"}', "line 3: prompt field 'prompt' is empty"),
    ('{"prompt": "2+2", "answer": NaN}', "line 3: answer field 'answer' is nan"),
    ('{"prompt": "2+2", "answer": 4', "line 3: not valid JSON"),
    ("[1, 2]", "line 3: expected a JSON object, got list"),
    ('{"prompt": "1+1", "answer": 2}', "line 3: key 'row-"),  # a duplicate of line 1
]


def test_a_bad_line_is_named_and_nothing_is_enqueued(served_run, engine, tmp_path):
    run, env = served_run
    data = tmp_path / "bad.jsonl"
    for bad, needle in BAD_LINES:  # one API server for every case (starting one is the slow part)
        data.write_text('{"prompt": "1+1", "answer": 2}\n{"prompt": "2+3", "answer": "5"}\n' + bad + "\n")
        out = staleflow(
            "enqueue", str(run), "--jsonl", str(data), "--prompt-field", "prompt", "--answer-field", "answer", **env
        )
        msg = " ".join(out.stderr.split())
        assert out.returncode == 1, msg
        assert needle in msg and "nothing was enqueued" in msg, msg
        assert _groups(engine, run) == []


def test_what_the_run_or_the_api_would_refuse_is_refused_up_front(served_run, engine, tmp_path):
    run, env = served_run
    args = ["enqueue", str(run), "--prompt-field", "prompt", "--answer-field", "answer", "--key-field", "id"]
    cases = [
        ({"id": "a", "prompt": "x" * 5000, "answer": "1"}, "line 2: the prompt is 5000 tokens"),
        ({"id": "k" * 600, "prompt": "1+1", "answer": "2"}, "line 2: client_key: String should have at most 500"),
        ({"id": "b", "prompt": "1+1", "answer": "2" * 70_000}, "line 2: meta: Value error, over 65536 bytes"),
    ]
    for bad, needle in cases:
        data = tmp_path / "refused.jsonl"
        data.write_text(json.dumps({"id": "ok", "prompt": "2+2", "answer": 4}) + "\n" + json.dumps(bad) + "\n")
        out = staleflow(*args, "--jsonl", str(data), **env)
        msg = " ".join(out.stderr.split())
        assert out.returncode == 1 and needle in msg and "nothing was enqueued" in msg, msg
        assert _groups(engine, run) == []


@pytest.mark.parametrize(
    "args",
    [
        ["reward-worker", "--run", "1", "--verifier", "math", "--model", "/nonexistent"],
        ["enqueue", "1", "--jsonl", str(REPO / "pyproject.toml"), "--prompt-field", "p", "--answer-field", "a"],
    ],
)
def test_bad_model_or_file_is_refused_before_the_api_is_asked(args):
    """A wrong --model or a file of no known format fails at once, no API needed."""
    out = staleflow(*args, STALEFLOW_API_URL="http://127.0.0.1:9")
    msg = " ".join((out.stdout + out.stderr).split())
    assert out.returncode in (1, 2), msg
    assert ("not a Hugging Face model" in msg) or ("pass --format jsonl or --format parquet" in msg), msg


def test_enqueue_tokenizes_with_a_model_folder(served_run, engine, tmp_path):
    pytest.importorskip("transformers")
    from hf_helpers import make_tiny_hf_model

    from workers.models.hf import encode_prompt, load_tokenizer

    run, env = served_run
    folder = make_tiny_hf_model(tmp_path / "model")
    data = tmp_path / "words.jsonl"
    data.write_text(json.dumps({"q": "Write a exactly 3 times .", "a": 3}) + "\n")
    args = ["enqueue", str(run), "--jsonl", str(data), "--prompt-field", "q", "--answer-field", "a"]
    out = staleflow(*args, "--model", str(folder), **env)
    assert out.returncode == 0, out.stdout + out.stderr
    with engine.connect() as c:
        tokens, meta = c.execute(
            text("SELECT prompt_tokens, meta FROM prompt_groups WHERE run_id = :r"), {"r": run}
        ).one()
    assert list(tokens) == encode_prompt(load_tokenizer(folder), "Write a exactly 3 times .")  # its chat template
    assert meta == {"answer": "3"}


# ---- data formats, templates, chat templates ---------------------------------------------

RECORDS = [{"id": f"q{i}", "question": f"{i} + {i}", "answer": 2 * i, "level": i % 3} for i in range(30)]


def _formats(tmp_path) -> dict[str, tuple[str, list[str]]]:
    """The same records in every format (ids prefixed by the format), and the extra options."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")

    def records(prefix: str) -> list[dict]:
        return [{**r, "id": f"{prefix}-{r['id']}"} for r in RECORDS]

    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records("jsonl")))
    parquet = tmp_path / "data.parquet"  # several row groups, read batch by batch
    pq.write_table(pa.Table.from_pylist(records("parquet")), parquet, row_group_size=8)
    datasets.Dataset.from_list(records("saved")).save_to_disk(tmp_path / "saved")
    split = records("dict")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(split), "test": datasets.Dataset.from_list(split[:2])}
    ).save_to_disk(tmp_path / "dict")
    folder = tmp_path / "folder" / "data"  # data files as load_dataset reads them: two shards
    folder.mkdir(parents=True)
    shards = records("folder")
    pq.write_table(pa.Table.from_pylist(shards[:10]), folder / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(shards[10:]), folder / "train-00001-of-00002.parquet")
    return {
        "jsonl": (str(jsonl), []),
        "parquet": (str(parquet), []),
        "saved": (str(tmp_path / "saved"), []),
        "dict": (str(tmp_path / "dict"), ["--split", "train"]),
        "folder": (str(tmp_path / "folder"), []),
    }


def test_every_format_enqueues_its_rows_with_the_template_and_meta(served_run, engine, tmp_path):
    run, env = served_run
    options = ["--template", "Solve: {question}", "--answer-field", "answer", "--meta-field", "level"]
    for name, (path, extra) in _formats(tmp_path).items():
        out = staleflow("enqueue", str(run), "--data", path, *extra, *options, "--key-field", "id", **env)
        msg = " ".join(out.stderr.split())
        assert out.returncode == 0, msg
        assert f"enqueued {len(RECORDS)} prompts" in msg and f"({len(RECORDS)} new, 0 enqueued before)" in msg, msg
        with engine.connect() as c:
            got = c.execute(
                text(
                    "SELECT client_key, prompt_tokens, meta FROM prompt_groups WHERE run_id = :r AND client_key LIKE :k"
                ),
                {"r": run, "k": f"{name}-%"},
            ).all()
        by_key = {k: (bytes(t).decode(), m) for k, t, m in got}
        assert by_key == {
            f"{name}-{r['id']}": (f"Solve: {r['question']}", {"answer": str(r["answer"]), "level": r["level"]})
            for r in RECORDS
        }, name
    # the Parquet file's rows again, as JSON Lines: their keys are known, nothing new
    again = tmp_path / "again.jsonl"
    again.write_text("".join(json.dumps({**r, "id": f"parquet-{r['id']}"}) + "\n" for r in RECORDS))
    out = staleflow("enqueue", str(run), "--data", str(again), *options, "--key-field", "id", **env)
    assert out.returncode == 0 and f"(0 new, {len(RECORDS)} enqueued before)" in " ".join(out.stderr.split())
    assert len(_groups(engine, run)) == 5 * len(RECORDS)


def test_chat_template_and_a_column_of_messages_with_a_real_tokenizer(served_run, engine, tmp_path):
    pytest.importorskip("transformers")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from hf_helpers import make_tiny_hf_model

    from workers.models.hf import encode_messages, load_tokenizer

    run, env = served_run
    folder = make_tiny_hf_model(tmp_path / "model")
    tok = load_tokenizer(folder)
    rows = [
        {
            "id": "m0",
            "answer": 3,
            "messages": [{"role": "system", "content": "Write a"}, {"role": "user", "content": "exactly 3 times ."}],
        },
        {"id": "m1", "answer": 4, "messages": [{"role": "user", "content": "Write b exactly 4 times ."}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"id": "t0", "w": "c", "n": 5, "answer": 5}) + "\n")
    common = ["--answer-field", "answer", "--key-field", "id", "--tokenizer", str(folder)]
    for args in (
        ["--data", str(tmp_path / "chat.parquet"), "--messages-field", "messages"],
        ["--data", str(words), "--template", "Write {w} exactly {n} times .", "--chat-template"],
    ):
        out = staleflow("enqueue", str(run), *args, *common, **env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "chat template" in " ".join(out.stderr.split())
    with engine.connect() as c:
        got = dict(
            c.execute(text("SELECT client_key, prompt_tokens FROM prompt_groups WHERE run_id = :r"), {"r": run}).all()
        )
    assert got == {
        "m0": encode_messages(tok, rows[0]["messages"]),
        "m1": encode_messages(tok, rows[1]["messages"]),
        "t0": encode_messages(tok, [{"role": "user", "content": "Write c exactly 5 times ."}]),
    }
    # --no-chat-template: the plain text, with the tokenizer's own special tokens
    out = staleflow(
        "enqueue",
        str(run),
        "--data",
        str(words),
        "--template",
        "Write {w} .",
        "--no-chat-template",
        *common[:2],
        "--tokenizer",
        str(folder),
        **env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # a column of messages without a tokenizer: refused before anything is read or sent
    out = staleflow(
        "enqueue", str(run), "--data", str(tmp_path / "chat.parquet"), "--messages-field", "messages", **env
    )
    assert out.returncode == 1 and "--messages-field needs --tokenizer FOLDER" in " ".join(out.stderr.split())


BAD_ROWS = [
    ({"q": "1+1", "a": 2}, None),
    (
        {"q": "Compute the sum of all the numbers from one to one hundred.", "a": 5050},
        "line 2: the prompt is 59 tokens, over the run's max_prompt_tokens (8)",
    ),
    ('{"q": "2+2", "a": 4', "line 3: not valid JSON"),
    ({"q": "2+2"}, "line 4: no answer field 'a' (columns: q); change --answer-field"),
    ({"q": " ", "a": 1}, "line 5: prompt field 'q' is empty"),
    ({"q": ["2+2"], "a": 4}, "line 6: prompt field 'q' must be a string or a number, got list"),
    ({"q": "3+3", "a": 6}, None),
]


def test_every_refusal_is_listed_and_skip_invalid_leaves_out_only_those(served_run, engine, db_url, tmp_path):
    _, env = served_run
    run = Protocol(engine).create_run("short", RunConfig(batch_size=2, group_size=2, eta=1, max_prompt_tokens=8))
    env = {**env, "STALEFLOW_TOKEN": token(db_url, "trainer", run)}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r, _ in BAD_ROWS))
    args = ["enqueue", str(run), "--data", str(data), "--prompt-field", "q", "--answer-field", "a"]
    out = staleflow(*args, **env)
    msg = " ".join(out.stderr.split())
    assert out.returncode == 1, msg
    for _, needle in BAD_ROWS:
        assert needle is None or f"{data}: {needle}" in msg, (needle, msg)
    # what to change for a long prompt: the limit, the longest prompt, the setting that takes it
    assert "longest 59 tokens" in msg and "a run created with max_prompt_tokens of at least 59" in msg, msg
    assert "5 of 7 rows refused (listed above); nothing was enqueued" in msg, msg
    assert _groups(engine, run) == []

    out = staleflow(*args, "--skip-invalid", **env)
    msg = " ".join(out.stderr.split())
    assert out.returncode == 0, msg
    for _, needle in BAD_ROWS:
        assert needle is None or f"skipped {data}: {needle}" in msg, (needle, msg)
    assert "enqueued 2 prompts" in msg and "(2 new, 0 enqueued before); 5 rows skipped (listed above)" in msg, msg
    assert [bytes(t).decode() for t in _prompts(engine, run)] == ["1+1", "3+3"]


def _prompts(engine, run: int) -> list:
    with engine.connect() as c:
        return list(
            c.execute(
                text("SELECT prompt_tokens FROM prompt_groups WHERE run_id = :r ORDER BY id"), {"r": run}
            ).scalars()
        )


def test_a_missing_column_is_refused_before_the_api_is_asked(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist([{"problem": "1+1", "solution": "2"}]), tmp_path / "d.parquet")
    out = staleflow(
        "enqueue", "1", "--data", str(tmp_path / "d.parquet"), "--template", "Solve: {question}",
        "--answer-field", "answer", STALEFLOW_API_URL="http://127.0.0.1:9",
    )  # fmt: skip
    msg = " ".join(out.stderr.split())
    assert out.returncode == 1, msg
    assert "no column 'question' (named by --template; columns: problem, solution)" in msg, msg
    assert "no column 'answer' (named by --answer-field; columns: problem, solution)" in msg, msg
