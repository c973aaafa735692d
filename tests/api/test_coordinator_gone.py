"""The REST coordinator endpoints are gone (410): our coordinator runs in-process against the
database (`staleflow coordinator`). They answer clearly and change nothing."""

from __future__ import annotations

from sqlalchemy import text

from api.auth import create_token
from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig
from tests.api_helpers import in_process


def test_lease_release_and_cycle_answer_gone(db_url, engine):
    p = Protocol(engine)
    run = p.create_run("r", RunConfig(batch_size=1, group_size=1, eta=0))
    token = create_token(engine, "coordinator", run)["token"]
    with in_process(db_url, max_wait=0.2) as http:
        http.headers["Authorization"] = f"Bearer {token}"
        for path, body in (
            ("lease", {"holder": "h", "ttl_seconds": 5}),
            ("release", {"holder": "h"}),
            ("cycle", {"holder": "h", "epoch": 1, "routes": [[1, 1]]}),
        ):
            r = http.post(f"/v1/runs/{run}/coordinator/{path}", json=body)
            assert r.status_code == 410, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "gone"
            assert "staleflow coordinator" in err["message"] and "database" in err["message"]
        paths = http.get("/openapi.json").json()["paths"]
        assert all(paths[f"/v1/runs/{{run_id}}/coordinator/{x}"]["post"]["deprecated"] for x in ("lease", "cycle"))
    with engine.connect() as c:  # nothing applied: no leader epoch taken, no cycle recorded
        for table in ("leader_epochs", "coordinator_cycles", "commands"):
            assert c.execute(text(f"SELECT count(*) FROM {table}")).scalar() == 0
