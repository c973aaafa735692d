"""The API's view of its database across outages.

Requests that find the database down answer 503 (api/errors.py) and tell the watch; the first
one logs the outage (one line, not one per request), counts it in /metrics
(`staleflow_database_outages_total`) and wakes a background probe, which checks the database
every `probe_s` until it answers, then logs its return. /readyz feeds the watch too.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import Engine

from staleflow_db.db import ping
from workers.retry import DATABASE_PROBE, Outage

log = logging.getLogger("staleflow.api")


class DatabaseWatch:
    def __init__(self, engine: Engine, registry: CollectorRegistry, probe_s: float = 0.5):
        self.engine, self.probe_s = engine, probe_s
        self.outage = Outage("the database", log)
        self.outages = Counter("staleflow_database_outages", "database outages this replica noticed", registry=registry)
        self._down: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def down(self) -> bool:
        return self.outage.down

    def failed(self, exc: BaseException) -> None:
        """A request found the database unavailable (any thread)."""
        if not self.outage.down:
            self.outages.inc()
        self.outage.failed(exc)
        if self._loop is not None and self._down is not None:
            self._loop.call_soon_threadsafe(self._down.set)

    def ok(self) -> None:
        self.outage.ok()

    async def start(self) -> asyncio.Task[None]:
        self._loop, self._down = asyncio.get_running_loop(), asyncio.Event()
        return asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        assert self._down is not None
        # Probe every probe_s until the database answers (or a request saw it answer).
        until_back = DATABASE_PROBE.but(initial=self.probe_s, cap=self.probe_s).async_retrying(self.outage)
        while True:
            await self._down.wait()
            await asyncio.sleep(self.probe_s)
            await until_back(self._probe_while_down)
            self._down.clear()

    async def _probe_while_down(self) -> None:
        if self.outage.down:
            await asyncio.to_thread(self._probe)
            self.ok()

    def _probe(self) -> None:
        with self.engine.connect() as conn:
            ping(conn)
