"""The dashboard's reward metrics and reward_failed drops in a real browser (Debian's Chromium,
driven by Playwright), from a static report of a run driven through the protocol: a step
trained with rewards that carry metrics, a sample dropped as reward_failed. A screenshot is
saved under $STALEFLOW_TEST_ARTIFACTS (default tests/artifacts/)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from protocol_helpers import Driver

from api.ui.report import dashboard_data, write_report_html

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("STALEFLOW_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("STALEFLOW_TEST_ARTIFACTS") or Path(__file__).parents[1] / "artifacts")

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(
        f"no Chromium at {CHROMIUM}: apt-get install chromium (Debian's), or set STALEFLOW_CHROMIUM",
        allow_module_level=True,
    )


def test_report_shows_reward_metrics_per_step_and_reward_failed_drops(engine, tmp_path):
    d = Driver(engine, batch_size=1, group_size=2, samples_per_group=3, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    for step in range(2):
        (g,) = d.enqueue(1)
        d.finish(d.routed(d.members(g), inst), version=step)
        a, b, c = d.p.claim_rewards(d.run, 10)
        d.p.drop_rewards(d.run, [(a.sample_id, a.reward_attempt)])  # its reward kept failing
        d.p.record_rewards(
            d.run,
            [
                (b.sample_id, b.reward_attempt, 1.0, {"accuracy": 1.0, "length": 10.0 + step}),
                (c.sample_id, c.reward_attempt, 0.0, {"accuracy": 0.0, "length": 20.0 + step}),
            ],
        )
        d.train(step)
    data = dashboard_data(d.p.reads, d.run)
    assert data["steps"]["reward_metrics"] == [
        {"step": 0, "metric": "accuracy", "mean": 0.5, "n": 2},
        {"step": 0, "metric": "length", "mean": 15.0, "n": 2},
        {"step": 1, "metric": "accuracy", "mean": 0.5, "n": 2},
        {"step": 1, "metric": "length", "mean": 16.0, "n": 2},
    ]
    path = write_report_html(tmp_path / "report", data)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.route(re.compile(r"^https?://"), lambda route: route.abort())  # nothing from the network
            page.goto(path.as_uri())
            table = page.locator("table.reward-metrics")
            assert table.locator("th").all_inner_texts() == ["step", "accuracy", "length"]
            assert page.locator("tr[data-step='1'] [data-metric='length']").inner_text() == "16.000"
            assert page.locator("tr[data-step='0'] [data-metric='accuracy']").inner_text() == "0.500"
            assert page.locator("tr[data-reason='reward_failed'] td.num").inner_text() == "2"
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "report-reward-metrics.png"), full_page=True)
        finally:
            browser.close()
