"""`staleflow dataset arithmetic` and `staleflow enqueue --jsonl` against a real API and
database: the answer lands in each prompt's metadata, a second run enqueues nothing new, and
a bad line is refused by number before anything is sent."""

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
    ('{"prompt": "1+1", "answer": 2}', "line 3: key 'jsonl-"),  # a duplicate of line 1
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
    """A wrong --model or a non-JSONL file fails at once, no API needed."""
    out = staleflow(*args, STALEFLOW_API_URL="http://127.0.0.1:9")
    msg = " ".join((out.stdout + out.stderr).split())
    assert out.returncode in (1, 2), msg
    assert ("not a Hugging Face model" in msg) or ("line 1: not valid JSON" in msg), msg


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
