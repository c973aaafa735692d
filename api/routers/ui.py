"""The run dashboard: HTML pages under /ui and the JSON behind each panel under
/v1/runs/{run_id}/dashboard (docs/api.md#dashboard). Read-only; every role may look, an
`observer` token may do nothing else.

A browser cannot set an Authorization header on a link, so `/ui/login?token=…` checks the
token once and keeps it in an HttpOnly, SameSite=Strict cookie; the dashboard's pages and
JSON accept either that cookie or the usual bearer header.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Cookie, Depends, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from staleflow_db.notify import BATCH
from staleflow_db.protocol.reads import DASHBOARD_PANELS
from workers.wire.models import errors

from ..auth import Principal
from ..body import ModelBodyRoute
from ..deps import AppState, RunId, State, run_filter
from ..notify import wait_for
from ..ui import pages

router = APIRouter(route_class=ModelBodyRoute, responses=errors(401, 403, 422, 503))
COOKIE = "staleflow_token"
REFRESH_S = 1.0  # the stream re-reads at most this often (sooner after a publish)
AUDIT_EVERY_S = 15.0  # the complete audit scans every segment: at most this often per viewer
PANELS = (*DASHBOARD_PANELS, "audit")
Panel = Annotated[str, Path(pattern=f"^({'|'.join(PANELS)})$", description=", ".join(PANELS))]

_bearer = HTTPBearer(auto_error=False)


def _lookup(state: AppState, token: str | None) -> Principal | None:
    if not token or len(token) > 200:
        return None
    return state.tokens.lookup(token)


def viewer(
    state: State,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    cookie: Annotated[str | None, Cookie(alias=COOKIE)] = None,
) -> Principal:
    """Any valid token, from the bearer header or the dashboard's cookie."""
    who = _lookup(state, creds.credentials if creds else cookie)
    if who is None:
        raise HTTPException(
            401, "missing, invalid or revoked token (sign in at /ui/login)", {"WWW-Authenticate": "Bearer"}
        )
    return who


Viewer = Annotated[Principal, Depends(viewer)]


def run_viewer(run_id: RunId, who: Viewer) -> Principal:
    if not who.may_use_run(run_id):
        raise HTTPException(403, f"this token is limited to run {who.run_id}")
    return who


RunViewer = Annotated[Principal, Depends(run_viewer)]


# ---- pages --------------------------------------------------------------------------------


def _page_viewer(state: State, cookie: Annotated[str | None, Cookie(alias=COOKIE)] = None) -> Principal | None:
    return _lookup(state, cookie)


PageViewer = Annotated[Principal | None, Depends(_page_viewer)]


def _refused(back: str) -> HTMLResponse:
    return HTMLResponse(pages.login_page("Sign in with a token to see the dashboard.", back), status_code=401)


@router.get("/ui/login", response_class=HTMLResponse, include_in_schema=False)
def login(state: State, token: Annotated[str | None, Query(max_length=200)] = None, next: str = "/ui") -> Response:
    # Only local paths: an open redirect would let a link send the signed-in user anywhere.
    target = next if next.startswith("/ui") and not next.startswith("/ui//") else "/ui"
    if token is None:
        return HTMLResponse(pages.login_page(next=target))
    if _lookup(state, token) is None:
        return HTMLResponse(pages.login_page("That token is invalid or revoked.", target), status_code=401)
    out = RedirectResponse(target, status_code=303)
    out.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
    return out


@router.get("/ui/logout", include_in_schema=False)
def logout() -> Response:
    out = RedirectResponse("/ui/login", status_code=303)
    out.delete_cookie(COOKIE, path="/")
    return out


@router.get("/ui", response_class=HTMLResponse, include_in_schema=False)
def runs_page(state: State, who: PageViewer) -> HTMLResponse:
    if who is None:
        return _refused("/ui")
    runs = state.protocol.reads.list_runs(run_filter(who, None), 500, 0)
    return HTMLResponse(pages.runs_page(jsonable_encoder(runs)))


@router.get("/ui/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
def run_page(run_id: RunId, state: State, who: PageViewer) -> HTMLResponse:
    if who is None:
        return _refused(f"/ui/runs/{run_id}")
    if not who.may_use_run(run_id):
        raise HTTPException(403, f"this token is limited to run {who.run_id}")
    return HTMLResponse(pages.run_page(run_id, state.protocol.reads.get_run(run_id).name))


@router.get("/ui/static/{name}", include_in_schema=False)
def static(name: str) -> FileResponse:
    if name not in pages.ASSETS:
        raise HTTPException(404, f"no asset {name}")
    return FileResponse(pages.STATIC / name, headers={"Cache-Control": "no-cache"})


# ---- JSON ---------------------------------------------------------------------------------


@router.get("/v1/runs/{run_id}/dashboard", responses=errors(404), tags=["dashboard"])
def dashboard(
    run_id: RunId, state: State, who: RunViewer, audit: bool = Query(False, description="include the complete audit")
) -> dict[str, Any]:
    """Every panel of the run's dashboard in one consistent read (`audit`: with the verdict of
    the complete audit, which scans every segment)."""
    panels = DASHBOARD_PANELS + (("audit",) if audit else ())
    data: dict[str, Any] = jsonable_encoder(state.protocol.reads.dashboard(run_id, panels))
    return data


async def _stream_viewer(run_id: RunId, state: State, who: RunViewer) -> Principal:
    """401/403, then 404 for an unknown run: answered before the stream (and its 200) starts."""
    await run_in_threadpool(state.protocol.reads.get_run, run_id)
    return who


# OpenAPI cannot describe an endless event stream (and generated clients would hang on it):
# it is documented in docs/api.md instead. FastAPI's EventSourceResponse sends the headers
# that keep proxies from buffering it (Cache-Control: no-cache, X-Accel-Buffering: no) and a
# keep-alive comment whenever the generator is quiet for 15 s.
@router.get("/v1/runs/{run_id}/dashboard/stream", response_class=EventSourceResponse, include_in_schema=False)
async def stream(
    run_id: RunId, request: Request, state: State, who: Annotated[Principal, Depends(_stream_viewer)]
) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events: the whole dashboard (as from `GET .../dashboard?audit=true`) as
    each event's data, sent when it changed; re-read every second and after each publish.
    It ends when the server is told to stop (the browser's EventSource connects again)."""
    last, audit, audited_at = "", None, -AUDIT_EVERY_S
    while not state.notifier.draining and not await request.is_disconnected():
        woken = state.notifier.event(run_id, BATCH)
        panels: tuple[str, ...] = DASHBOARD_PANELS
        if time.monotonic() - audited_at >= AUDIT_EVERY_S:
            panels, audited_at = (*panels, "audit"), time.monotonic()
        data = await run_in_threadpool(state.protocol.reads.dashboard, run_id, panels)
        audit = data.setdefault("audit", audit)
        body = json.dumps(jsonable_encoder(data), separators=(",", ":"))
        # an unchanged dashboard sends a comment, which also finds a closed connection
        yield ServerSentEvent(raw_data=body) if body != last else ServerSentEvent(comment="unchanged")
        last = body
        await wait_for(woken, REFRESH_S)


@router.get("/v1/runs/{run_id}/dashboard/{panel}", responses=errors(404), tags=["dashboard"])
def panel(run_id: RunId, panel: Panel, state: State, who: RunViewer) -> dict[str, Any]:
    """One panel: steps, staleness, instances, queue, coordinator, drops or audit."""
    data = state.protocol.reads.dashboard(run_id, (panel,))
    body: dict[str, Any] = jsonable_encoder({"run": data["run"], panel: data[panel]})
    return body
