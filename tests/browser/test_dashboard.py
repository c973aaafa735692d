"""The dashboard in a real browser: the service on a real database, a `sim` run in progress,
headless Chromium (Debian's, driven by Playwright). Each panel must show what the database
holds, follow new steps live, refuse a request without a token; screenshots are saved under
$STALEFLOW_TEST_ARTIFACTS (default tests/artifacts/) for a person to look at."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from api.auth import create_token
from api.ui.report import dashboard_data, write_report_html
from staleflow_cli.launch import Cluster
from staleflow_db.db import make_engine
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from workers.tasks.repeat import RepeatTask

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("STALEFLOW_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("STALEFLOW_TEST_ARTIFACTS") or Path(__file__).parents[1] / "artifacts")
WAIT_MS = 30_000

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(
        f"no Chromium at {CHROMIUM}: apt-get install chromium (Debian's), or set STALEFLOW_CHROMIUM",
        allow_module_level=True,
    )


@pytest.fixture
def live_run(db_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A sim run in progress: the API, two sim rollout workers, reward worker, coordinator, trainer."""
    engine = make_engine(db_url)
    protocol = Protocol(engine)
    task = RepeatTask()
    prompts = task.prompts(400, seed=1, prefix="ui")
    run = protocol.create_run(
        "dashboard",
        RunConfig(
            batch_size=4,
            buffer_capacity=6,  # redundancy: some groups and samples are dropped, with reasons
            group_size=2,
            samples_per_group=3,
            eta=2,
            dapo_filter=False,
            max_response_tokens=task.max_response,
            max_prompt_tokens=max(len(t) for _, t, _ in prompts),
        ),
    )
    protocol.enqueue(run, [Prompt(k, t, m) for k, t, m in prompts])
    admin = create_token(engine, "admin", run)["token"]
    observer = create_token(engine, "observer", run, "dashboard")["token"]
    with Cluster(tmp_path, db_url, {"STALEFLOW_TOKEN": admin}) as cluster:
        url = cluster.start_api()
        common = ["--run", str(run)]
        for i in range(2):
            sim = ["--engine", "sim", "--time-scale", "0.5", "--heartbeat", "0.3", "--name", f"sim-{i}"]
            cluster.spawn(f"rollout-{i}", ["rollout-worker", *common, *sim])
        cluster.spawn("reward", ["reward-worker", *common, "--verifier", "repeat"])
        cluster.spawn("coordinator", ["coordinator", *common, "--lease", "3"])
        # paced steps, so the test sees the page follow each publish
        cluster.spawn("trainer", ["trainer", *common, "--sim", "--time-scale", "0.1", "--wait", "1"])
        try:
            yield {
                "url": url,
                "run": run,
                "observer": observer,
                "engine": engine,
                "protocol": protocol,
                "cluster": cluster,
            }
        finally:
            cluster.stop()
            engine.dispose()


@pytest.fixture
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


def _db(engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as c:
        return c.execute(text(sql), params).all()


def _version(engine, run: int) -> int:
    return _db(engine, "SELECT version FROM runs WHERE id = :r", r=run)[0][0]


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def test_refused_without_a_token(live_run, browser):
    url, run = live_run["url"], live_run["run"]
    for path in (f"/v1/runs/{run}/dashboard", f"/v1/runs/{run}/dashboard/steps", f"/v1/runs/{run}/dashboard/stream"):
        assert httpx.get(url + path).status_code == 401, path
    assert httpx.get(url + "/v1/runs/1/dashboard", headers={"Authorization": "Bearer sf_bogus"}).status_code == 401
    page = browser.new_page()
    response = page.goto(f"{url}/ui/runs/{run}")
    assert response.status == 401
    assert page.locator("input[name=token]").is_visible()  # the sign-in form, no data
    assert page.locator("[data-panel]").count() == 0
    _shot(page, "login")
    # signing in with the form lands on the page that was refused
    page.fill("input[name=token]", live_run["observer"])
    page.click("button[type=submit]")
    page.wait_for_url(f"**/ui/runs/{run}")
    page.wait_for_selector("#live.on", timeout=WAIT_MS)
    page.context.clear_cookies()
    assert page.goto(f"{url}/ui/login?token=sf_bogus").status == 401
    # an observer reads everything of its run and writes nothing
    obs = {"Authorization": f"Bearer {live_run['observer']}"}
    assert httpx.get(f"{url}/v1/runs/{run}/dashboard/queue", headers=obs).status_code == 200
    assert httpx.get(f"{url}/v1/runs/{run}/snapshot", headers=obs).status_code == 200
    assert httpx.post(f"{url}/v1/runs/{run}/instances/expire", headers=obs).status_code == 403
    assert httpx.post(f"{url}/v1/runs/{run}/prompts", headers=obs, json={"prompts": []}).status_code in (403, 422)


def test_dashboard_shows_the_database_and_follows_new_steps(live_run, browser):
    url, run, engine = live_run["url"], live_run["run"], live_run["engine"]
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    page.goto(f"{url}/ui/login?token={live_run['observer']}")
    assert page.url.endswith("/ui")
    _shot(page, "runs")
    link = page.locator(f"#runs a[href='/ui/runs/{run}']").first
    assert link.is_visible()
    link.click()
    page.wait_for_url(f"**/ui/runs/{run}")
    page.wait_for_selector("#live.on", timeout=WAIT_MS)

    # live: a publish shows up without reloading the page
    _wait(lambda: _version(engine, run) >= 2, "two published steps")
    shown = int(page.locator("[data-k=run_version]").inner_text())
    _wait(lambda: _version(engine, run) > shown, "another publish")
    newer = _version(engine, run)
    page.wait_for_function(
        f"Number(document.querySelector('[data-k=run_version]').textContent) >= {newer}", timeout=WAIT_MS
    )
    assert int(page.locator("[data-k=steps] b").inner_text()) >= newer
    try:  # for the picture: a moment with an instance generating
        page.wait_for_selector(".tag.busy, .tag.overloaded", timeout=10_000)
    except sync_api.TimeoutError:
        pass
    _shot(page, "dashboard-live")

    # quiesce (nothing routes or trains any more; the rollout workers stay, idle), then every
    # panel must equal the database
    live_run["cluster"].stop("trainer")
    live_run["cluster"].stop("coordinator")
    page.wait_for_selector("[data-k=audit]", timeout=WAIT_MS)
    _check_panels(page, engine, run)
    _shot(page, "dashboard")


def _check_panels(page, engine, run: int) -> None:
    """Compare what the page shows with the database, retrying while the run moves on."""
    deadline = time.monotonic() + 30
    while True:
        try:
            _compare(page, engine, run)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _compare(page, engine, run: int) -> None:
    def kv(key: str) -> str:
        return page.locator(f"[data-k={key}] b").first.inner_text()

    version = _version(engine, run)
    assert int(page.locator("[data-k=run_version]").inner_text()) == version
    # steps: the last step's reward, mean ± std over its trained samples
    last = _db(
        engine,
        "SELECT avg(s.reward), coalesce(stddev_pop(s.reward), 0) FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
        " WHERE s.run_id = :r AND g.state = 'consumed' AND s.state = 'rewarded' AND g.buffer = :b",
        r=run,
        b=version - 1,
    )[0]
    assert kv("steps") == str(version)
    assert kv("reward") == f"{last[0]:.3f} ± {last[1]:.3f}"
    # staleness: trained samples in all
    trained = _db(
        engine,
        "SELECT count(*) FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
        " WHERE s.run_id = :r AND g.state = 'consumed' AND s.state = 'rewarded'",
        r=run,
    )[0][0]
    assert kv("trained").replace(",", "") == str(trained)
    # buffers
    for idx, occupied, reserved in _db(
        engine, "SELECT idx, occupied, reserved FROM buffers WHERE run_id = :r AND consumed_at IS NULL", r=run
    ):
        cells = page.locator(f"tr[data-buffer='{idx}'] td").all_inner_texts()
        assert cells[1:3] == [str(occupied), str(reserved)], (idx, cells)
    # instances: each active one with its version
    active = _db(engine, "SELECT id, version FROM instances WHERE run_id = :r AND state = 'active'", r=run)
    assert kv("active") == str(len(active))
    for iid, v in active:
        assert page.locator(f"tr[data-instance='{iid}'] [data-k=version]").inner_text() == str(v)
    # queue by level
    queued = _db(engine, "SELECT count(*) FROM samples WHERE run_id = :r AND state = 'queued'", r=run)[0][0]
    assert kv("queued") == str(queued)
    # coordinator: its recorded cycles (the page shows up to 200)
    cycles = _db(engine, "SELECT count(*) FROM coordinator_cycles WHERE run_id = :r", r=run)[0][0]
    assert kv("cycles") == str(min(cycles, 200))
    # drops by reason
    dropped = dict(
        _db(engine, "SELECT reason, count(*) FROM samples WHERE run_id = :r AND state = 'aborted' GROUP BY 1", r=run)
    )
    assert kv("dropped") == str(sum(dropped.values()))
    for reason, n in dropped.items():
        assert page.locator(f"tr[data-reason='{reason}'] td").nth(1).inner_text() == str(n)
    # the audit's verdict: green when the complete audit is empty
    violations = _db(engine, "SELECT count(*) FROM staleness_violations WHERE run_id = :r", r=run)[0][0]
    verdict = page.locator("[data-k=audit]")
    assert ("ok" in verdict.get_attribute("class")) == (violations == 0)


def test_static_report_shows_the_same_panels(live_run, browser, tmp_path):
    engine, run = live_run["engine"], live_run["run"]
    _wait(lambda: _version(engine, run) >= 2, "two published steps")
    data = dashboard_data(live_run["protocol"].reads, run)
    path = write_report_html(tmp_path / "report", data)
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    page.route(re.compile(r"^https?://"), lambda route: route.abort())  # nothing from the network
    page.goto(path.as_uri())
    # the link the demo prints: sign in and land on the run
    live = browser.new_page()
    live.goto(f"{live_run['url']}/ui/login?token={live_run['observer']}&next=/ui/runs/{run}")
    assert live.url.endswith(f"/ui/runs/{run}")
    live.close()
    assert page.locator("#live").inner_text() == "report"
    assert int(page.locator("[data-k=run_version]").inner_text()) == data["run"]["version"]
    assert int(page.locator("[data-k=steps] b").inner_text()) == data["run"]["version"]
    assert page.locator("[data-k=audit]").is_visible()
    _shot(page, "report")
