"""Pages of the dashboard, rendered from the templates next to this file. The same run page
serves live (the script reads the server-sent events) and static (the data is inlined)."""

from __future__ import annotations

import html
import json
from functools import cache
from pathlib import Path
from string import Template
from typing import Any

HERE = Path(__file__).parent
STATIC = HERE / "static"
ASSETS = ("dashboard.js", "dashboard.css", "samples.js", "samples.css")


@cache
def _template(name: str) -> Template:
    return Template((HERE / "templates" / name).read_text())


@cache
def asset(name: str) -> str:
    return (STATIC / name).read_text()


def _page(title: str, body: str, head: str = "") -> str:
    return _template("base.html").substitute(title=html.escape(title), body=body, head=head)


def _linked_assets() -> str:
    return '<link rel="stylesheet" href="/ui/static/dashboard.css">'


def login_page(message: str = "", next: str = "/ui") -> str:
    """`next`: where to go once signed in."""
    note = f'<p class="error">{html.escape(message)}</p>' if message else ""
    body = _template("login.html").substitute(message=note, next=html.escape(next))
    return _page("StaleFlow: sign in", body, _linked_assets())


def runs_page(runs: list[dict[str, Any]]) -> str:
    rows = "".join(
        f'<tr><td><a href="/ui/runs/{r["id"]}">{r["id"]}</a></td><td><a href="/ui/runs/{r["id"]}">'
        f"{html.escape(r['name'])}</a></td><td>{html.escape(r['state'])}</td><td>{r['version']}</td>"
        f"<td>{r['config']['eta']}</td>"
        f"<td>{r['config']['batch_size']}</td><td>{html.escape(str(r['created_at'])[:19])}</td></tr>"
        for r in runs
    )
    body = _template("runs.html").substitute(rows=rows or '<tr><td colspan="6">no runs yet</td></tr>')
    return _page("StaleFlow: runs", body, _linked_assets())


def _inline_json(data: Any) -> str:
    # Inside <script>, "</" would end the element: escape it (JSON allows "\/").
    return json.dumps(data, default=str).replace("</", "<\\/")


def run_page(run_id: int, name: str, data: Any | None = None) -> str:
    """`data` None: live (the script subscribes to the stream); else static, self-contained."""
    if data is None:
        head = _linked_assets()
        script = (
            f"<script>window.SF = {{live: true, run: {run_id}}};</script>"
            '<script src="/ui/static/dashboard.js"></script>'
        )
    else:
        head = f"<style>{asset('dashboard.css')}</style>"
        script = (
            f"<script>window.SF = {{live: false, run: {run_id}, data: {_inline_json(data)}}};</script>"
            f"<script>{asset('dashboard.js')}</script>"
        )
    # the sample browser needs the service: a static report has no link to it
    links = f'<a href="/ui/runs/{run_id}/samples" id="samples-link">samples</a>' if data is None else ""
    body = _template("run.html").substitute(run_id=run_id, name=html.escape(name), script=script, links=links)
    return _page(f"StaleFlow: run {name}", body, head)


def _browser_page(template: str, title: str, run_id: int, name: str, sf: dict[str, Any]) -> str:
    head = _linked_assets() + '<link rel="stylesheet" href="/ui/static/samples.css">'
    script = f'<script>window.SF = {_inline_json(sf)};</script><script src="/ui/static/samples.js"></script>'
    body = _template(template).substitute(run_id=run_id, name=html.escape(name), script=script, **sf)
    return _page(title, body, head)


def samples_page(run_id: int, name: str) -> str:
    """The sample browser of a run: filters and a keyset-paged list (samples.js fills it)."""
    return _browser_page("samples.html", f"StaleFlow: samples of {name}", run_id, name, {"run": run_id, "page": "list"})


def sample_page(run_id: int, name: str, sample_id: int) -> str:
    """One sample: text, turns, versions, timeline and reward (samples.js fills it)."""
    sf = {"run": run_id, "page": "sample", "sample": sample_id}
    return _browser_page("sample.html", f"StaleFlow: sample {sample_id} of {name}", run_id, name, sf)
