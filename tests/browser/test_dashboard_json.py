"""The dashboard's JSON, pages and static report without a browser (runs wherever the test
database does): one step walked through the API, then every panel against what it did."""

from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy import text

from api.ui.report import dashboard_data, write_report_html
from staleflow_db.db import make_engine
from staleflow_db.protocol import Protocol
from tests.api_helpers import ROLES, ApiServer, token, walk_lifecycle

pytestmark = pytest.mark.slow


def _db(db_url: str, what: str, source: str):
    engine = make_engine(db_url)
    try:
        with engine.connect() as c:
            return c.execute(text(f"SELECT {what} FROM {source}")).scalar()
    finally:
        engine.dispose()


def test_panels_pages_and_report(db_url, tmp_path):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("json", batch_size=2, group_size=2, eta=1, samples_per_group=2).id
        roles = {r: server.client(token(db_url, r, run)) for r in ROLES}
        walk_lifecycle(admin, roles, run)
        observer = token(db_url, "observer", run)
        auth = {"Authorization": f"Bearer {observer}"}
        get = lambda path, **kw: httpx.get(server.url + path, timeout=10, **kw)  # noqa: E731

        d = get(f"/v1/runs/{run}/dashboard?audit=true", headers=auth).json()
        assert d["run"]["version"] == 1 and d["run"]["eta"] == 1 and d["run"]["name"] == "json"
        (step,) = d["steps"]["steps"]
        # walk_lifecycle: 4 samples, rewards sample_id % 2
        assert step["step"] == 0 and step["samples"] == 4 and step["tokens"] == _db(db_url, "sum(n_tokens)", "samples")
        assert step["reward_mean"] == pytest.approx(0.5) and step["reward_std"] == pytest.approx(0.5)
        assert step["tokens_per_s"] > 0
        assert sum(h["n"] for h in d["staleness"]["histogram"]) == 4
        assert {h["staleness"] for h in d["staleness"]["histogram"]} == {0}
        open_buffers = _db(db_url, "array_agg(idx ORDER BY idx)", "buffers WHERE consumed_at IS NULL")
        assert [b["idx"] for b in d["staleness"]["buffers"]] == open_buffers
        assert d["instances"]["instances"] == []  # deregistered at the end of the walk
        assert d["queue"]["levels"] == [] and d["queue"]["samples"] == {"rewarded": 4}
        assert [c["kind"] for c in d["coordinator"]["commands"]] == ["interrupt"]
        assert d["drops"]["reasons"] == []
        assert d["audit"] == {"ok": True, "violations": []}
        one = get(f"/v1/runs/{run}/dashboard/queue", headers=auth).json()
        assert set(one) == {"run", "queue"} and one["queue"] == d["queue"]
        assert get(f"/v1/runs/{run}/dashboard/nope", headers=auth).status_code == 422
        assert get(f"/v1/runs/{run + 1}/dashboard", headers=auth).status_code == 403  # another run

        # pages: refused without a token, served with the cookie the login sets
        assert get(f"/ui/runs/{run}").status_code == 401
        assert get(f"/v1/runs/{run}/dashboard/stream").status_code == 401
        with httpx.Client(base_url=server.url, timeout=10) as browser:
            r = browser.get(f"/ui/login?token={observer}&next=//evil.example")
            assert r.status_code == 303 and r.headers["location"] == "/ui"
            assert "httponly" in r.headers["set-cookie"].lower()
            listed = browser.get("/ui").text
            assert f'href="/ui/runs/{run}"' in listed and "<td>active</td>" in listed  # the run's state
            assert "dashboard.js" in browser.get(f"/ui/runs/{run}").text
            assert browser.get(f"/v1/runs/{run}/dashboard/steps").status_code == 200
            assert browser.get("/ui/static/dashboard.js").status_code == 200
            assert browser.get("/ui/static/../../auth.py").status_code == 404
            with browser.stream("GET", f"/v1/runs/{run}/dashboard/stream") as s:
                assert s.headers["content-type"].startswith("text/event-stream")
                first = next(s.iter_lines())
                assert first.startswith("data: {") and '"audit":{"violations":[],"ok":true}' in first

    engine = make_engine(db_url)
    try:
        data = dashboard_data(Protocol(engine).reads, run)
    finally:
        engine.dispose()
    page = write_report_html(tmp_path, data).read_text()
    assert "window.SF = {live: false" in page and "/ui/static/" not in page  # self-contained
    assert '"reward_mean": 0.5' in page


def test_the_event_stream_is_not_buffered_by_proxies(db_url):
    """Over real HTTP: the stream says `no-cache` and `X-Accel-Buffering: no` (so nginx and
    other proxies pass each event on at once) and sends the dashboard as its first event;
    refusals (no token, another run, a run that does not exist) are plain JSON errors
    answered before any stream starts."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("stream", batch_size=1, group_size=1, eta=0).id
        auth = {"Authorization": f"Bearer {token(db_url, 'observer', run)}"}
        with httpx.Client(base_url=server.url, timeout=10) as http:
            with http.stream("GET", f"/v1/runs/{run}/dashboard/stream", headers=auth) as s:
                assert s.status_code == 200
                assert s.headers["content-type"].startswith("text/event-stream")
                assert s.headers["cache-control"] == "no-cache"
                assert s.headers["x-accel-buffering"] == "no"
                first = next(s.iter_lines())
                assert first.startswith("data: {")
                event = json.loads(first.removeprefix("data: "))
                assert event["run"]["id"] == run and event["audit"] == {"violations": [], "ok": True}
            for headers, path, status in (
                ({}, f"/v1/runs/{run}/dashboard/stream", 401),
                (auth, f"/v1/runs/{run + 1}/dashboard/stream", 403),
                ({"Authorization": f"Bearer {token(db_url, 'observer')}"}, "/v1/runs/999999/dashboard/stream", 404),
            ):
                r = http.get(path, headers=headers)
                assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
                assert r.json()["error"]["code"] in {"unauthorized", "forbidden", "not_found"}
