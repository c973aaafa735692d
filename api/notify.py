"""Wake-ups for long-polls (ENGINEERING pattern 7).

After a commit the handler calls `publish(run, topics)`: waiters of this process wake at once,
and other replicas hear about it through at most one debounced NOTIFY per run (the payload and
its channel: `staleflow_db.notify`). NOTIFY takes a global lock at commit, so it is never sent
per row nor inside the protocol transactions. Waiters also re-check on a timer, so a lost
NOTIFY (or a writer that bypasses the API without one) costs latency, never correctness.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict

import psycopg
from sqlalchemy import Engine

from staleflow_db import notify
from staleflow_db.notify import (
    BATCH,
    REWARDS,
    TOPICS,
    WORK,
    Wakeup,
    alive_statement,
    instance_topic,
    listen_statement,
)
from workers.retry import LISTEN_RECONNECT, Outage

log = logging.getLogger(__name__)

__all__ = ["BATCH", "REWARDS", "TOPICS", "WORK", "Notifier", "instance_topic", "wait_any", "wait_for"]


class Notifier:
    def __init__(self, engine: Engine, url: str | None, debounce: float, listen: bool = True):
        self.engine, self.url, self.debounce, self.listen = engine, url, debounce, listen
        self.sender_id = uuid.uuid4().hex[:12]
        self._events: dict[tuple[int, str], asyncio.Event] = {}
        # (run, topic) -> the keys of its subtopics' events: a publish of `work` wakes the
        # instances' `work:<id>` waiters without scanning every waiter of the process
        self._subtopics: dict[tuple[int, str], set[tuple[int, str]]] = {}
        self._pending: dict[int, set[str]] = defaultdict(set)
        self._dirty: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.listening = False  # the LISTEN connection is up (for /readyz and tests)
        self.draining = False  # the server is stopping: long-polls answer what they have (api/draining.py)
        self.connection = Outage("the LISTEN connection", log)  # one log line per loss, one when back

    # ---- waiting (event-loop thread only) ---------------------------------------------------

    def event(self, run_id: int, topic: str) -> asyncio.Event:
        """The event the next `publish` of (run, topic) sets. Take it *before* checking the
        database, so a commit between the check and the wait is not missed."""
        key = (run_id, topic)
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = asyncio.Event()
            parent, sub, _ = topic.partition(":")
            if sub:
                self._subtopics.setdefault((run_id, parent), set()).add(key)
        return ev

    def _wake(self, run_id: int, topics: set[str] | tuple[str, ...]) -> None:
        """A topic wakes its own waiters and those of its subtopics: `work` wakes `work:<instance>`."""
        for topic in topics:
            ev = self._events.pop((run_id, topic), None)
            if ev is not None:
                ev.set()
            parent, sub, _ = topic.partition(":")
            if sub:
                if ev is not None:
                    self._subtopics.get((run_id, parent), set()).discard((run_id, topic))
                continue
            for key in self._subtopics.pop((run_id, topic), ()):
                self._events.pop(key).set()

    def drain(self) -> None:
        """Every long-poll, waiting or to come, answers what it has now (event-loop thread)."""
        self.draining = True
        self._wake_all()

    def _wake_all(self) -> None:
        events, self._events = self._events, {}
        self._subtopics = {}
        for ev in events.values():
            ev.set()

    # ---- publishing (any thread) -------------------------------------------------------------

    def publish(self, run_id: int, *topics: str) -> None:
        if self._loop is None or not topics:
            return
        self._loop.call_soon_threadsafe(self._publish, run_id, topics)

    def _publish(self, run_id: int, topics: tuple[str, ...]) -> None:
        self._wake(run_id, topics)
        if self.listen and self._dirty is not None:
            self._pending[run_id].update(topics)
            self._dirty.set()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._dirty = asyncio.Event()
        if self.listen and self.url:
            self._tasks = [asyncio.create_task(self._sender()), asyncio.create_task(self._listener())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._wake_all()

    async def _sender(self) -> None:
        """Leading-edge debounce: the first change goes out at once, later ones in the same
        window are merged into one NOTIFY per run."""
        assert self._dirty is not None
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            batch, self._pending = self._pending, defaultdict(set)
            wakeups = [Wakeup.of(self.sender_id, run, t) for run, t in batch.items()]
            try:
                await asyncio.to_thread(self._send, wakeups)
            except Exception as exc:  # the database is down: waiters fall back to polling
                log.debug("NOTIFY failed: %s", exc)
            await asyncio.sleep(self.debounce)

    def _send(self, wakeups: list[Wakeup]) -> None:
        with self.engine.begin() as conn:
            notify.send(conn, wakeups)

    async def _listener(self) -> None:
        """Keep one LISTEN connection up. A lost one is reconnected with capped backoff (a
        fresh backoff per loss); meanwhile long-polls fall back to their polling timer."""
        url = self.url
        assert url is not None  # started only with a URL
        while True:
            conn: psycopg.AsyncConnection | None = None
            try:
                async for attempt in LISTEN_RECONNECT.async_retrying(self.connection):
                    with attempt:
                        conn = await psycopg.AsyncConnection.connect(
                            url,
                            autocommit=True,
                            connect_timeout=5,
                            application_name="staleflow-api-listen",
                        )
                        try:
                            await conn.execute(listen_statement())
                        except BaseException:
                            await conn.close()
                            raise
                assert conn is not None
                async with conn:
                    self.listening = True
                    self.connection.ok()
                    self._wake_all()  # anything may have happened while we were not listening
                    while True:
                        async for n in conn.notifies(timeout=10.0):
                            self._received(n.payload)
                        await conn.execute(alive_statement())  # a dead connection raises here
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.listening:
                    # Held long-polls wait on the listening interval; wake them so they re-check
                    # now and wait on the polling interval until it is back (a database outage
                    # then reaches their callers as 503 instead of hiding behind the wait).
                    self.listening = False
                    self._wake_all()
                self.connection.failed(exc)  # long-polls fall back to polling meanwhile

    def _received(self, payload: str) -> None:
        wakeup = Wakeup.parse(payload)
        if wakeup is not None and wakeup.sender != self.sender_id:
            self._wake(wakeup.run_id, wakeup.topics)


async def wait_for(event: asyncio.Event, timeout: float) -> bool:
    """True if the event fired within `timeout` seconds."""
    if timeout <= 0:
        return event.is_set()
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False


async def wait_any(events: list[asyncio.Event], timeout: float) -> bool:
    """True if any of the events fired within `timeout` seconds (a node's long-poll waits on
    each of its instances' topics)."""
    if len(events) == 1:
        return await wait_for(events[0], timeout)
    if timeout <= 0 or any(e.is_set() for e in events):
        return any(e.is_set() for e in events)
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return bool(done)
    finally:
        for w in waits:
            w.cancel()
