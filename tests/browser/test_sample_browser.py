"""The sample browser in a real browser (Debian's Chromium, driven by Playwright) against
`staleflow serve` on a real database holding a run with a trained single-turn sample, a trained
multi-turn sample interrupted on one instance and migrated to another across a publish, a
dropped sample and one in flight (tests/sample_browser_helpers.py). The list is filtered from
its form, paged, and a sample opened: its turns, its segments coloured by model version (the
legend's colours), its timeline's interruption and migration, its reward and scorer must show.
Screenshots are saved under $STALEFLOW_TEST_ARTIFACTS (default tests/artifacts/)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.auth import create_token
from tests.api_helpers import ApiServer
from tests.sample_browser_helpers import B_OBSERVATION, B_TURN1, B_TURN2, browsable_run

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
def served(db_url: str, engine: Any) -> Iterator[dict[str, Any]]:
    ids = browsable_run(engine)
    observer = create_token(engine, "observer", ids["run"], "browser")["token"]
    with ApiServer(db_url) as api:
        yield {**ids, "url": api.url, "observer": observer}


@pytest.fixture
def page(served: dict[str, Any]) -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            pg = b.new_page(viewport={"width": 1400, "height": 1000})
            pg.goto(f"{served['url']}/ui/login?token={served['observer']}")
            yield pg
        finally:
            b.close()


def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _submit(page: Any) -> None:
    """Submit the filter form and wait for the list it asked for."""
    _click_and_wait(page, "#filters button[type=submit]")


def _listed(page: Any) -> list[int]:
    return [
        int(x)
        for x in page.locator("#samples tbody tr[data-sample]").evaluate_all("rs => rs.map(r => r.dataset.sample)")
    ]


def _unfilter(page: Any) -> None:
    page.locator("#filters input[name=status]").evaluate_all("xs => xs.forEach(x => (x.checked = false))")
    for name in (
        "step",
        "reward_min",
        "reward_max",
        "staleness_min",
        "staleness_max",
        "length_min",
        "length_max",
        "limit",
    ):
        page.fill(f"#filters input[name={name}]", "")


def test_filter_the_list_and_open_a_migrated_multi_turn_sample(served, page):
    url, run = served["url"], served["run"]
    a, b, c, d = (served[k] for k in "abcd")
    # from the run's dashboard to its samples
    page.goto(f"{url}/ui/runs/{run}")
    page.click("#samples-link")
    page.wait_for_url(f"**/ui/runs/{run}/samples")
    page.wait_for_selector("#samples tbody tr[data-sample]", timeout=WAIT_MS)
    assert _listed(page) == [d, c, b, a]
    assert page.locator(f"tr[data-sample='{c}']").get_attribute("data-status") == "dropped"
    assert page.locator(f"tr[data-sample='{d}'] .status").inner_text() == "in flight"

    page.check("#filters input[value=trained]")
    _submit(page)
    assert _listed(page) == [b, a]
    assert "status=trained" in page.url  # the filtered list is a link
    page.fill("#filters input[name=staleness_min]", "1")
    _submit(page)
    assert _listed(page) == [b]
    assert page.locator(f"tr[data-sample='{b}'] [data-k=reward]").inner_text() == "0.500"
    _unfilter(page)
    page.check("#filters input[value=dropped]")
    _submit(page)
    assert _listed(page) == [c]
    _unfilter(page)
    page.fill("#filters input[name=reward_min]", "0.9")
    _submit(page)
    assert _listed(page) == [a]
    _unfilter(page)
    page.fill("#filters input[name=length_min]", "5")
    page.fill("#filters input[name=length_max]", "2")
    _submit(page)
    assert "length_min" in page.locator("#problem").inner_text()  # the API's 422, shown
    _unfilter(page)
    page.check("#filters input[value=trained]")
    page.fill("#filters input[name=staleness_min]", "1")
    _submit(page)
    _shot(page, "sample-browser-list")

    # open the multi-turn sample
    page.click(f"tr[data-sample='{b}'] a")
    page.wait_for_url(f"**/ui/runs/{run}/samples/{b}")
    page.wait_for_selector("#turns .turn", timeout=WAIT_MS)
    assert page.locator("#prompt").inner_text() == "Qb: 2+2?"
    turns = page.locator("#turns .turn")
    assert turns.count() == 3  # turn 1, the observation, turn 2
    assert page.locator(".turn[data-turn='1'] pre").text_content() == "".join(B_TURN1)
    assert page.locator(".turn.observation pre").text_content() == B_OBSERVATION
    assert page.locator(".turn[data-turn='2'] pre").text_content() == B_TURN2
    assert page.locator("[data-k=turns] b").inner_text() == "2"

    # each generated segment has its version's colour, as the legend shows it
    legend = {
        v: page.locator(f"#legend span[data-version='{v}'] i").evaluate("e => getComputedStyle(e).backgroundColor")
        for v in ("0", "1")
    }
    assert legend["0"] != legend["1"]
    segs = page.locator("#turns .seg[data-version]")
    shown = segs.evaluate_all(
        "ss => ss.map(s => [s.dataset.seq, s.dataset.version, getComputedStyle(s).backgroundColor, s.textContent])"
    )
    assert [(seq, v, text) for seq, v, _, text in shown] == [
        ("0", "0", B_TURN1[0]),
        ("1", "0", B_TURN1[1]),
        ("2", "1", B_TURN1[2]),
        ("4", "1", B_TURN2),
    ]
    assert all(colour == legend[v] for _, v, colour, _ in shown)
    obs = page.locator("#turns .seg.observation")
    assert obs.count() == 1 and obs.get_attribute("data-version") is None

    # the timeline: the coordinator's interrupt, the interruption, the migration, the reward
    timeline = page.locator("#timeline li")
    kinds = timeline.evaluate_all("ls => ls.map(l => l.dataset.kind)")
    for kind in ("command_interrupt", "sample_interrupted", "migration", "observation", "sample_rewarded"):
        assert kind in kinds, kinds
    assert kinds.index("sample_interrupted") < kinds.index("migration") < kinds.index("sample_rewarded")
    assert "migrated from gpu-0 to gpu-1" in page.locator("#timeline li[data-kind=migration]").inner_text()
    assert "interrupt command to gpu-0" in page.locator("#timeline li[data-kind=command_interrupt]").inner_text()

    # the reward, who scored it, the staleness
    assert page.locator("#reward [data-k=reward]").inner_text() == "0.500"
    assert (
        page.locator("#reward [data-k=scorer]").inner_text() == f"scored by token {served['scorer']} “judge” (reward)"
    )
    assert page.locator("#reward [data-metric=accuracy]").inner_text() == "accuracy 0.000"
    assert page.locator("[data-k=staleness] b").inner_text() == "1"
    assert page.locator("[data-k=step] b").inner_text() == "1"
    assert "UTF-8 bytes" in page.locator("#decoding").inner_text()
    _shot(page, "sample-browser-sample")

    # the dropped one says why
    page.goto(f"{url}/ui/runs/{run}/samples/{c}")
    page.wait_for_selector("[data-k=reason]", timeout=WAIT_MS)
    assert page.locator("[data-k=reason] b").inner_text() == "env_failed"
    assert page.locator("#timeline li[data-kind=sample_aborted]").count() == 1


def test_pages_refuse_without_a_token_and_page_through_the_list(served, page):
    url, run = served["url"], served["run"]
    page.goto(f"{url}/ui/runs/{run}/samples?status=trained&status=dropped")
    page.wait_for_selector("#samples tbody tr[data-sample]", timeout=WAIT_MS)
    assert _listed(page) == [served["c"], served["b"], served["a"]]  # filters read from the link
    assert page.locator("#filters input[value=dropped]").is_checked()
    page.context.clear_cookies()
    for path in (f"/ui/runs/{run}/samples", f"/ui/runs/{run}/samples/{served['a']}"):
        response = page.goto(url + path)
        assert response.status == 401
        assert page.locator("input[name=token]").is_visible()
    assert page.request.get(f"{url}/v1/runs/{run}/samples").status == 401
    # signed in again: the whole list is one page
    page.goto(f"{url}/ui/login?token={served['observer']}&next=/ui/runs/{run}/samples")
    page.wait_for_url(re.compile(rf".*/ui/runs/{run}/samples$"))
    page.wait_for_selector("#samples tbody tr[data-sample]", timeout=WAIT_MS)
    assert _listed(page) == [served[k] for k in "dcba"] and page.locator("#next").is_disabled()
    # three a page: the second page holds the oldest, and no further page
    page.fill("#filters input[name=limit]", "3")
    _submit(page)
    assert _listed(page) == [served[k] for k in "dcb"] and page.locator("#next").is_enabled()
    _click_and_wait(page, "#next")
    assert _listed(page) == [served["a"]] and page.locator("#next").is_disabled()
    _click_and_wait(page, "#first")
    assert _listed(page) == [served[k] for k in "dcb"]


def _click_and_wait(page: Any, selector: str) -> None:
    before = page.evaluate("document.body.dataset.loaded || ''")
    page.click(selector)
    page.wait_for_function(f"(document.body.dataset.loaded || '') !== {before!r}", timeout=WAIT_MS)
