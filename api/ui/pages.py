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
ASSETS = ("dashboard.js", "dashboard.css")


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
    body = _template("run.html").substitute(run_id=run_id, name=html.escape(name), script=script)
    return _page(f"StaleFlow: run {name}", body, head)
