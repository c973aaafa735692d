"""Every error as ``{"error": {"code": ..., "message": ...}}`` with the right status.

Protocol refusals map one to one (InvalidInput 422, TooLarge 413, NotFound 404, Conflict 409);
a database that cannot be reached (or a lock/statement timeout) is 503 with Retry-After, so
clients retry; a value the database refuses (SQLSTATE class 22) is the caller's bad input.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from staleflow_db.errors import Conflict, InvalidInput, NotFound, ProtocolError, TooLarge
from staleflow_db.retry import is_db_unavailable
from workers.wire.packed import untagged

log = logging.getLogger(__name__)

HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
    503: "unavailable",
}


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **extra}}


def _json(status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(code, message, **extra), status_code=status, headers=headers)


def _location(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc if p != "body") or "body"


def _outage(request: Request, exc: Exception) -> None:
    """One log line per outage (the app's DatabaseWatch), not one per failed request."""
    watch = getattr(request.app.state, "database_watch", None)
    if watch is not None:
        watch.failed(exc)
    else:
        log.warning("database unavailable: %s", str(getattr(exc, "orig", None) or exc).splitlines()[0])


def install(app: FastAPI, retry_after: int) -> None:
    unavailable = {"Retry-After": str(retry_after)}

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = untagged(exc.errors())
        shown = "; ".join(f"{_location(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:5])
        more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
        details = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in errors[:20]]
        return _json(422, "invalid_input", shown + more, details=details)

    @app.exception_handler(StarletteHTTPException)
    async def http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
        return _json(exc.status_code, code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(ProtocolError)
    async def protocol(_: Request, exc: ProtocolError) -> JSONResponse:
        if isinstance(exc, TooLarge):
            return _json(413, exc.code, str(exc))
        if isinstance(exc, InvalidInput):
            return _json(422, exc.code, str(exc))
        if isinstance(exc, NotFound):
            return _json(404, exc.code, f"{exc} does not exist")
        if isinstance(exc, Conflict):
            items = [{"id": i, "reason": why} for i, why in exc.items[:100]]
            return _json(409, exc.code, str(exc), items=items)
        return _json(400, exc.code, str(exc))

    @app.exception_handler(DBAPIError)
    async def database(request: Request, exc: DBAPIError) -> JSONResponse:
        sqlstate = getattr(exc.orig, "sqlstate", None) or ""
        if isinstance(exc, (OperationalError, InterfaceError)) or exc.connection_invalidated:
            _outage(request, exc)
            return _json(503, "database_unavailable", "the database is unavailable; retry later", unavailable)
        if sqlstate.startswith("22"):  # data exception: a value the database refuses
            return _json(422, "invalid_input", str(exc.orig).splitlines()[0])
        if isinstance(exc, IntegrityError):
            return _json(409, "conflict", str(exc.orig).splitlines()[0])
        log.exception("database error")
        return _json(500, "internal", "internal database error")

    @app.exception_handler(PoolTimeout)
    async def pool_timeout(request: Request, exc: PoolTimeout) -> JSONResponse:
        _outage(request, exc)
        return _json(503, "database_unavailable", "no database connection free; retry later", unavailable)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        if is_db_unavailable(exc):  # e.g. SQLAlchemy's DisconnectionError while a pool is invalidated
            _outage(request, exc)
            return _json(503, "database_unavailable", "the database is unavailable; retry later", unavailable)
        log.exception("unhandled error")
        return _json(500, "internal", "internal server error")
