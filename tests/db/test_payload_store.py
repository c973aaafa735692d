"""The payload store: finished segments' payloads move to objects (a folder, or an S3-compatible
server over HTTP: moto's standalone server), the rows keep metadata and lineage, and the audit
and the export read through the store: the export writes the same files with and without the
offload; the audit proves the payload checks by forging what they must catch."""

from __future__ import annotations

import filecmp
import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from audit_helpers import forge, found, healthy_run
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from staleflow_db.audit import violations
from staleflow_db.payload_store import _offload_batch, offload_run, open_store
from staleflow_db.payloads import pack_logprobs
from staleflow_db.protocol import Protocol
from staleflow_db.protocol.samples import SampleReads
from tests.db.test_turns import turns  # noqa: F401  (the fixture: a trajectory of turns trained at step 1)
from workers.export import export

pytest.importorskip("fsspec")


def _export(engine, run: int, out: Path, fmt: str) -> Path:
    reads = Protocol(engine).reads
    export(lambda after, n: reads.export_page(run, after, n, False), out, {"run": run}, fmt=fmt, page=3, chunk=7)
    return out


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and len(names) > 2
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], []), mismatch


def _where(engine, run: int) -> tuple[int, int]:
    """(segments holding their payload, segments whose payload is in the store)."""
    with engine.connect() as c:
        row = c.execute(
            text(
                "SELECT count(*) FILTER (WHERE token_ids IS NOT NULL), count(*) FILTER (WHERE payload_object IS NOT NULL)"
                " FROM segments WHERE run_id = :r"
            ),
            {"r": run},
        ).one()
    return int(row[0]), int(row[1])


def _offload_and_compare(engine, run: int, store_url: str, tmp_path: Path) -> None:
    formats = ["jsonl"] + (["parquet"] if _has("pyarrow") else [])
    before = {f: _export(engine, run, tmp_path / f"before-{f}", f) for f in formats}
    resident, stored = _where(engine, run)
    assert stored == 0 and resident > 0

    done = offload_run(engine, open_store(store_url), run)
    assert done.segments > 0 and done.objects >= 1
    resident_after, stored_after = _where(engine, run)
    assert stored_after == done.segments and resident_after == resident - done.segments
    assert offload_run(engine, open_store(store_url), run).segments == 0  # idempotent: nothing left

    for f in formats:
        _same_files(before[f], _export(engine, run, tmp_path / f"after-{f}", f))
    assert violations(engine, run) == []


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_offload_to_a_folder_and_read_through(engine, tmp_path):
    h = healthy_run(engine)
    _offload_and_compare(engine, h.run, (tmp_path / "store").as_uri(), tmp_path)
    # only finished segments moved: the trained and aborted ones; those of live samples stay
    with engine.connect() as c:
        live = c.execute(
            text(
                "SELECT count(*) FROM segments x JOIN samples s ON s.id = x.sample_id"
                " JOIN prompt_groups g ON g.id = s.group_id WHERE x.run_id = :r AND x.payload_object IS NOT NULL"
                " AND NOT (s.state = 'aborted' OR g.state = 'consumed')"
            ),
            {"r": h.run},
        ).scalar()
    assert live == 0 and _where(engine, h.run)[0] > 0  # buffer 2's and the running samples' stay


def test_the_trainer_and_the_rollout_keep_working_after_an_offload(engine, tmp_path, turns):  # noqa: F811
    d, a = turns
    offload_run(engine, open_store((tmp_path / "store").as_uri()), d.run)
    assert _where(engine, d.run)[0] == 0
    # a multi-turn trajectory's observation read through the store passes the audit
    assert violations(engine, d.run) == []
    rows = [r for r in Protocol(engine).reads.export_page(d.run, 0, 10, True) if r["sample_id"] == a]
    assert rows[0]["response_tokens"] == [1, 2, 50, 51, 3, 4] and rows[0]["loss_mask"] == [1, 1, 0, 0, 1, 1]
    # the sample browser's page reads its segments' tokens through the store too
    segments = SampleReads(engine).sample(d.run, a)["segments"]
    assert [t for x in segments for t in x["token_ids"]] == [1, 2, 50, 51, 3, 4]
    # and the run goes on: more work is routed, reported, trained
    i2 = d.p.register_instance(d.run, "i2", 2)
    (g,) = d.enqueue(1)
    d.complete(d.members(g), i2, version=2)
    d.train(2)
    assert violations(engine, d.run) == []


def test_a_crash_between_the_object_and_the_rows_leaves_the_rows_and_a_rerun_completes(engine, tmp_path):
    h = healthy_run(engine)
    store = open_store((tmp_path / "store").as_uri())
    before = _export(engine, h.run, tmp_path / "before", "jsonl")
    with engine.connect() as c:
        c.begin()
        assert _offload_batch(c, store, h.run) is not None  # the object is written ...
        c.rollback()  # ... and the process dies before its transaction commits
    assert len(list((tmp_path / "store").rglob("*.seg"))) == 1
    assert _where(engine, h.run)[1] == 0
    offload_run(engine, store, h.run)
    assert len(list((tmp_path / "store").rglob("*.seg"))) == 2  # the orphan stays, unreferenced
    _same_files(before, _export(engine, h.run, tmp_path / "after", "jsonl"))
    assert violations(engine, h.run) == []


def test_segments_allow_the_offload_and_nothing_else(engine, tmp_path):
    h = healthy_run(engine)
    offload_run(engine, open_store((tmp_path / "store").as_uri()), h.run)
    attempts = [
        "UPDATE segments SET version = version WHERE run_id = :r AND payload_object IS NOT NULL",  # an offloaded row
        "UPDATE segments SET finish_reason = 'x' WHERE run_id = :r AND token_ids IS NOT NULL",  # a resident row
        # an offload that also changes something else
        "UPDATE segments SET token_ids = NULL, logprobs = NULL, payload_object = (SELECT min(id) FROM payload_objects),"
        " payload_offset = 0, n_tokens = n_tokens + 1 WHERE run_id = :r AND token_ids IS NOT NULL",
        "DELETE FROM segments WHERE run_id = :r",
    ]
    for sql in attempts:
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as c:
            c.execute(text(sql), {"r": h.run})
    # the constraints: a payload in the row or in an object, never neither; aligned lengths
    for sql, check in [
        ("UPDATE segments SET token_ids = NULL, logprobs = NULL WHERE run_id = :r AND token_ids IS NOT NULL", "placed"),
        (
            "UPDATE segments SET token_ids = token_ids || '\\x00'::bytea WHERE run_id = :r AND token_ids IS NOT NULL",
            "aligned",
        ),
    ]:
        with pytest.raises(DBAPIError, match=check):
            forge(engine, sql.replace(":r", str(h.run)))


def test_audit_catches_a_changed_or_missing_object(engine, tmp_path):
    h = healthy_run(engine)
    offload_run(engine, open_store((tmp_path / "store").as_uri()), h.run)
    (obj,) = list((tmp_path / "store").rglob("*.seg"))
    data = bytearray(obj.read_bytes())
    data[5] ^= 1
    obj.write_bytes(bytes(data))
    assert {i for i, _ in found(engine, h.run)} == {"payload"}
    obj.unlink()
    assert {i for i, _ in found(engine, h.run)} == {"payload"}


def test_audit_catches_log_probs_on_an_offloaded_observation(engine, tmp_path, turns):  # noqa: F811
    """The observation's object is rewritten (a consistent SHA-256: only the content check can
    tell) with log-probs on the observed tokens."""
    d, a = turns
    offload_run(engine, open_store((tmp_path / "store").as_uri()), d.run)
    with engine.connect() as c:
        url, offset, n, oid = c.execute(
            text(
                "SELECT o.url, x.payload_offset, x.n_tokens, o.id FROM segments x JOIN payload_objects o"
                " ON o.id = x.payload_object WHERE x.sample_id = :s AND NOT x.generated"
            ),
            {"s": a},
        ).one()
    path = Path(url.removeprefix("file://"))
    data = bytearray(path.read_bytes())
    at = offset + 4 * n  # the log-probs follow the tokens
    data[at : at + 4 * n] = pack_logprobs([-1.0] * n)
    path.write_bytes(bytes(data))
    forge(engine, "UPDATE payload_objects SET sha256 = :h WHERE id = :o", h=hashlib.sha256(data).hexdigest(), o=oid)
    assert found(engine, d.run) == {("observation", f"sample {a}")}


# ---- an S3-compatible server over HTTP ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto's standalone S3 server on a free port (skipped when moto[server] is missing)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("s3fs", reason="s3fs (the store extra) is not installed")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"moto's server did not start (exit {proc.poll()})")
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


def test_offload_to_an_s3_compatible_server(engine, tmp_path, s3_server, monkeypatch):
    for k, v in {
        "STALEFLOW_PAYLOAD_STORE_ENDPOINT": s3_server,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}).mkdir("staleflow-test")
    h = healthy_run(engine)
    _offload_and_compare(engine, h.run, "s3://staleflow-test/payloads", tmp_path)
    with engine.connect() as c:
        urls = c.execute(text("SELECT url FROM payload_objects WHERE run_id = :r"), {"r": h.run}).scalars().all()
    assert urls and all(u.startswith("s3://staleflow-test/payloads/run-") for u in urls)
    assert os.environ["STALEFLOW_PAYLOAD_STORE_ENDPOINT"] == s3_server


def test_the_offload_command_reads_its_store_from_the_setting(db_url, engine, tmp_path):
    from tests.e2e.test_cli import staleflow

    h = healthy_run(engine)
    store = tmp_path / "by-setting"
    env = {**os.environ, "STALEFLOW_DATABASE_URL": db_url, "STALEFLOW_PAYLOAD_STORE": store.as_uri()}
    out = staleflow("offload", "healthy", env=env).stdout
    assert f"offload run {h.run}: " in out and store.as_uri() in out
    assert _where(engine, h.run)[1] > 0 and list(store.rglob("*.seg"))
    assert "0 segments" in staleflow("offload", str(h.run), env=env).stdout  # nothing left: idempotent
    bad = staleflow("offload", "healthy", "--store", "nosuchscheme://x", env=env, check=False)
    assert bad.returncode == 2 and "nosuchscheme" in bad.stderr
    assert violations(engine, h.run) == []
