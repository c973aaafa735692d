"""Lineage and export of a run driven through one training step over real HTTP: the lineage
endpoint and `staleflow lineage` (the scorer is the token that posted the rewards), and
`staleflow export` loaded back with Hugging Face `datasets` and pandas, `--trained` against
`--all`, and an interrupted export continued to the same files as an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from staleflow_db.db import make_engine
from staleflow_db.protocol import Protocol
from tests.api_helpers import ROLES, ApiServer, token, walk_lifecycle
from tests.e2e.test_cli import staleflow
from workers.export import export

pytestmark = pytest.mark.slow


def _drive(db_url: str):
    server = ApiServer(db_url).launch()
    admin = server.client(token(db_url, "admin"))
    run = admin.create_run("lineage", batch_size=2, group_size=2, eta=1, samples_per_group=2)
    roles = {r: server.client(token(db_url, r, run.id)) for r in ROLES}
    out = walk_lifecycle(admin, roles, run.id)
    roles["trainer"].enqueue(run.id, [("later0", [4, 5]), ("later1", [6])])
    return server, admin, roles, run, out


def test_lineage_and_export(db_url, tmp_path: Path):
    server, admin, roles, run, out = _drive(db_url)
    try:
        assert admin.violations(run.id) == []
        observer = server.client(token(db_url, "observer", run.id))
        rows = observer.lineage(run.id, 0)
        assert {r.sample_id for r in rows} == {s.sample_id for g in out["batch"].groups for s in g.samples}
        assert all(r.generated and r.version == 0 and r.checksum is None for r in rows)  # version 0: the initial model
        scorer = {r.scorer_token_id for r in rows}
        assert len(scorer) == 1 and None not in scorer and {r.scorer_role for r in rows} == {"reward"}
        cont = [r for r in rows if r.sample_id == out["continued"].sample_id]
        assert [r.seq for r in cont] == [0, 1, 2] and [r.attempt for r in cont] == [1, 1, 2]
        assert observer.lineage(run.id, 0, cont[0].sample_id) == cont
        with pytest.raises(Exception, match="404|not found|step 1"):
            observer.lineage(run.id, 1)
        # a rollout worker's token may not read it
        r = httpx.get(
            f"{server.url}/v1/runs/{run.id}/lineage",
            params={"step": 0},
            headers={"Authorization": f"Bearer {token(db_url, 'rollout', run.id)}"},
        )
        assert r.status_code == 403

        page = observer.export_page(run.id, after=0, limit=3)
        assert len(page.rows) == 3 and page.next_after == page.rows[-1].sample_id
        rest = observer.export_page(run.id, after=page.next_after, limit=100)
        assert rest.next_after is None and len(page.rows) + len(rest.rows) == 8

        # the CLI, on the database
        cli = json.loads(staleflow("lineage", "lineage", "--step", "0", "--json", env=_env(db_url)).stdout)
        assert [(r["sample_id"], r["seq"]) for r in cli] == [(r.sample_id, r.seq) for r in rows]
        table = staleflow("lineage", str(run.id), "--step", "0", env=_env(db_url)).stdout
        assert "reward" in table and "initial model" in table

        trained, every = tmp_path / "trained", tmp_path / "all"
        staleflow("export", "lineage", "--out", str(trained), "--trained", "--chunk", "3", env=_env(db_url))
        staleflow("export", "lineage", "--out", str(every), "--all", "--format", "jsonl", env=_env(db_url))
        _check_loads(trained, every, db_url, run.id, out)

        # the same files through the REST API (keyset pages of GET /v1/runs/{run}/export)
        rest = tmp_path / "rest"
        env = {**_env(db_url), "STALEFLOW_API_URL": server.url, "STALEFLOW_TOKEN": token(db_url, "observer", run.id)}
        staleflow("export", str(run.id), "--out", str(rest), "--trained", "--chunk", "3", "--via-api", env=env)
        for name in ("part-00000.parquet", "part-00001.parquet"):
            assert (rest / name).read_bytes() == (trained / name).read_bytes(), name

        # refusals name the problem
        bad = staleflow("export", "lineage", "--out", str(trained), "--all", env=_env(db_url), check=False)
        assert bad.returncode == 2 and "use another folder" in bad.stderr
        for params in ({"step": -1}, {}, {"step": 0, "sample": 0}):
            assert (
                httpx.get(
                    f"{server.url}/v1/runs/{run.id}/lineage", params=params, headers=_auth(db_url, run.id)
                ).status_code
                == 422
            )
        assert (
            httpx.get(
                f"{server.url}/v1/runs/{run.id}/export", params={"limit": 1001}, headers=_auth(db_url, run.id)
            ).status_code
            == 422
        )
        assert httpx.get(f"{server.url}/v1/runs/99/export", headers=_auth(db_url, None)).status_code == 404
    finally:
        server.stop()


def _auth(db_url: str, run_id: int | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(db_url, 'observer', run_id)}"}


def _env(db_url: str) -> dict[str, str]:
    import os

    return {**os.environ, "STALEFLOW_DATABASE_URL": db_url, "COLUMNS": "250"}


def _check_loads(trained: Path, every: Path, db_url: str, run_id: int, out) -> None:
    import datasets
    import pandas as pd

    manifest = json.loads((trained / "manifest.json").read_text())
    assert manifest["files"] == ["part-00000.parquet", "part-00001.parquet"] and manifest["rows"] == 4
    assert json.loads((trained / "run.json").read_text())["config"]["batch_size"] == 2
    files = [str(trained / f) for f in manifest["files"]]
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    assert ds.num_rows == 4 and set(ds["state"]) == {"rewarded"} and set(ds["step"]) == {0}
    df = pd.concat(pd.read_parquet(f) for f in files)
    engine = make_engine(db_url)
    try:
        trained_db = Protocol(engine).reads.audit("trained", run_id, 100, 0)
    finally:
        engine.dispose()
    assert sorted(df["sample_id"]) == sorted(t["sample_id"] for t in trained_db)
    by_id = {t["sample_id"]: t for t in trained_db}
    for row in ds:
        t = by_id[row["sample_id"]]
        assert len(row["response_tokens"]) == len(row["logprobs"]) == len(row["loss_mask"]) == t["n_tokens"]
        assert row["staleness"] == t["staleness"] and row["reward"] == t["reward"]
        assert sum(row["seg_lengths"]) == t["n_tokens"] and row["seg_versions"] == t["segment_versions"]
    cont = df[df["sample_id"] == out["continued"].sample_id].iloc[0]
    assert list(cont["response_tokens"]) == [7, 8, 9, 10] and list(cont["loss_mask"]) == [1, 1, 1, 1]

    lines = datasets.load_dataset("json", data_files=str(every / "part-00000.jsonl"), split="train")
    assert lines.num_rows == 8 and sorted(set(lines["state"])) == ["queued", "rewarded"]
    assert pd.read_json(every / "part-00000.jsonl", lines=True)["step"].isna().sum() == 4


class Interrupted(Exception):
    pass


def test_interrupted_export_continues_to_the_same_files(engine, tmp_path: Path):
    from audit_helpers import healthy_run

    healthy = healthy_run(engine)
    reads = Protocol(engine).reads
    run = {"id": healthy.d.run}
    source = lambda after, n: reads.export_page(healthy.d.run, after, n, False)  # noqa: E731
    total = reads.export_count(healthy.d.run, False)
    assert total >= 6
    whole = tmp_path / "whole"
    export(source, whole, run, page=2, chunk=3)

    calls = {"n": 0}

    def breaks(after: int, n: int):
        calls["n"] += 1
        if calls["n"] == 4:  # inside the second chunk: its file is never recorded
            raise Interrupted
        return source(after, n)

    part = tmp_path / "part"
    with pytest.raises(Interrupted):
        export(breaks, part, run, page=2, chunk=3)
    assert json.loads((part / "manifest.json").read_text())["files"] == ["part-00000.parquet"]
    resumed = export(source, part, run, page=2, chunk=3)
    assert resumed.rows == total
    names = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in part.iterdir()) == names
    for name in names:
        assert (part / name).read_bytes() == (whole / name).read_bytes(), name
    export(source, part, run, page=2, chunk=3)  # again: nothing new, nothing duplicated
    assert json.loads((part / "manifest.json").read_text())["rows"] == total
