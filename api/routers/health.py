"""Liveness, readiness and Prometheus metrics (no token: they are for the platform)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from ..body import ModelBodyRoute
from ..deps import State

router = APIRouter(route_class=ModelBodyRoute, tags=["health"])


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    database: bool
    schema_revision: str | None
    expected_revision: str | None
    listening: bool


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process answers (says nothing about the database)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, responses={503: {"model": Ready}})
def readyz(state: State, request: Request) -> JSONResponse:
    """Ready to serve: the database answers and its schema is at the newest migration (503
    while the database is down; ready again by itself once it is back)."""
    expected = state.schema_head
    watch = getattr(request.app.state, "database_watch", None)
    try:
        rev = state.protocol.reads.schema_revision()
        reachable = True
    except Exception as exc:
        rev, reachable = None, False
        if watch is not None:
            watch.failed(exc)
    else:
        if watch is not None:
            watch.ok()
    ok = reachable and rev == expected
    body = Ready(
        status="ready" if ok else ("database unavailable" if not reachable else "schema not current"),
        database=reachable,
        schema_revision=rev,
        expected_revision=expected,
        listening=state.notifier.listening,
    )
    headers = None if ok else {"Retry-After": str(state.settings.retry_after)}
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503, headers=headers)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(state: State) -> Response:
    """Prometheus text format: request and protocol transaction latencies, queue depth by level,
    buffers, staleness, instances, drops, coordinator cycles, lock waits (docs/metrics.md).
    Under `serve --workers N`: the sum over all N worker processes, whichever answers."""
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
