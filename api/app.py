"""The app factory. Stateless by design: everything durable is in PostgreSQL, so any number
of replicas may serve one database; in-process state is caches and long-poll wake-ups."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from staleflow_db import idempotency, migrate
from staleflow_db.db import database_url, make_engine

from . import errors
from .auth import TokenCache
from .database_watch import DatabaseWatch
from .deps import AppState
from .draining import drain_on_signals
from .errors import error_body
from .group_commit import GroupCommit
from .metrics import LatencyMiddleware, Metrics
from .notify import Notifier
from .routers import audit, coordinator, health, lineage, node, param_keys, rollout, runs, samples, training, ui
from .service import ApiProtocol
from .settings import ApiSettings

API_VERSION = "1"
YOUNG_COLLECTION_ALLOCATIONS = 20_000
log = logging.getLogger(__name__)


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or ApiSettings.from_env()
    url = database_url(settings.db)  # starts the embedded server when no URL is configured
    # No pre-ping (as the coordinator): a round trip per transaction, ~7% of the server's CPU per
    # heartbeat. A pooled connection that died with a database restart fails its first statement
    # instead: that request answers 503, which clients retry, and SQLAlchemy replaces the whole pool.
    engine = make_engine(
        url,
        settings=settings.db,
        connect_args={"connect_timeout": settings.connect_timeout},
        pool_pre_ping=False,
        **_kept_overflow(settings.db.pool_size, settings.db.max_overflow),
    )
    protocol = ApiProtocol(engine)
    metrics = Metrics(protocol.reads.metrics_rows)
    protocol.observe_transaction = protocol.reads.observe_transaction = metrics.observe
    watch = DatabaseWatch(engine, metrics.registry, probe_s=settings.probe_interval)
    state = AppState(
        settings=settings,
        engine=engine,
        protocol=protocol,
        # LISTEN is session-level: its own URL when the engine's goes through a pooler
        notifier=Notifier(engine, settings.db.listen_database_url or url, settings.notify_debounce, settings.listen),
        tokens=TokenCache(engine, settings.token_cache_seconds),
        metrics=metrics,
        writes=GroupCommit(
            protocol,
            metrics,
            enabled=settings.group_commit,
            window=settings.group_commit_window,
            max_items=settings.group_commit_max,
            lanes=settings.group_commit_lanes,
        ),
        url=url,
        schema_head=migrate.head(),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.notifier.start()
        restore_signals = drain_on_signals(state.notifier)
        watcher = await watch.start()
        pruner = asyncio.create_task(_prune_idempotency(state)) if settings.idempotency_ttl > 0 else None
        _freeze_startup_objects()
        _collect_less_often()
        try:
            yield
        finally:
            watcher.cancel()
            if pruner is not None:
                pruner.cancel()
            restore_signals()
            await state.notifier.stop()
            engine.dispose()

    app = FastAPI(
        **_no_native_telemetry(),
        title="StaleFlow",
        version=API_VERSION,
        description="Data layer for asynchronous RL post-training: every lifecycle step of a trajectory is "
        'one PostgreSQL transaction. Errors are `{"error": {"code", "message"}}`.',
        lifespan=lifespan,
    )
    app.state.staleflow = state
    app.state.database_watch = watch  # outage log and counter (errors.py, /readyz)
    errors.install(app, settings.retry_after)
    for module in (runs, node, rollout, training, param_keys, coordinator, audit, lineage, samples, health, ui):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(LatencyMiddleware, metrics=metrics)
    return app


def _freeze_startup_objects() -> None:
    """Move what the process holds once it can serve (modules, the app, its routes and models,
    ~150,000 objects) out of the garbage collector's sight: nothing of it is ever freed, yet
    every full collection would walk all of it, ~0.1 s with the event loop stopped, every few
    thousand requests (~40 us per heartbeat in all, measured with gc.callbacks)."""
    gc.collect()
    gc.freeze()


def _collect_less_often() -> None:
    """Start a young-generation collection after YOUNG_COLLECTION_ALLOCATIONS net allocations,
    not Python's 700: a request's objects (its body's models, rows, the response) live across
    many other requests' allocations, so at 700 most were scanned, promoted and scanned again
    before they died; ~5% of a replica's CPU in the collector under load (perf, docs/benchmarks.md)."""
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, *gc.get_threshold()[1:])


def _no_native_telemetry() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry hooks off (where FastAPI has them): the API exports its
    metrics itself (api/metrics.py), and the hooks asked the OpenTelemetry API on every
    request whether a provider was configured, ~3-5% of the server's CPU per heartbeat."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


async def _prune_idempotency(state: AppState, every: float = 60.0) -> None:
    """Stored outcomes outlive any retry by far after the TTL (every replica may prune them:
    concurrent deletes of the same rows are harmless)."""
    while True:
        await asyncio.sleep(every)
        try:
            await asyncio.to_thread(idempotency.prune, state.engine, state.settings.idempotency_ttl)
        except Exception as exc:  # the database is down; next time
            log.debug("idempotency pruning failed: %s", exc)


def _kept_overflow(pool_size: int, max_overflow: int) -> dict[str, int]:
    """The same cap on connections (pool + overflow), all kept once opened: SQLAlchemy closes an
    overflow connection when it is returned, so 64 long-polling workers made the replica open
    (and PostgreSQL fork) ~12 sessions a second. An unlimited overflow (-1) stays as it is."""
    if max_overflow < 0:
        return {}
    return {"pool_size": pool_size + max_overflow, "max_overflow": 0}


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` (what `staleflow serve` runs in each worker)."""
    return create_app(ApiSettings.from_env())


class BodyLimit:
    """Refuse bodies over the limit with 413 before the app sees them. A declared length is
    checked up front; a chunked body is read here (counting) and handed on from memory,
    because an error raised while FastAPI reads the body would become a 400.

    Not FastAPI's `max_body_size` (Starlette's RequestBodyLimitMiddleware): it answers a
    declared length over the limit with a plain-text "Content Too Large" that names no limit,
    and only once the response starts, so an endpoint that reads no body (DELETE of an
    instance, consume) has already run and changed the database (tests/api/test_api_errors.py)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await _send_413(send, self.max_bytes)
                return
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await _send_413(send, self.max_bytes)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _send_413(send: Send, limit: int) -> None:
    import json

    body = json.dumps(error_body("too_large", f"request body over {limit} bytes")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
