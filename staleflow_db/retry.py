"""Riding through outages of a dependency (the database, the API): which errors are outages,
a capped exponential backoff, and an outage log that says one line when the dependency goes
away and one when it is back (retries in between log at debug level only).

Built on tenacity; every long-running process retries outages forever, one-shot commands for
a bounded time. Anything that is not an outage (a refusal, a bug) is raised at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import exc as sa_exc
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, stop_never
from tenacity.wait import wait_exponential_jitter

# First retry after this long, doubling up to the cap: an outage of a few seconds is noticed
# within ~cap seconds of its end, and a long one costs one attempt per cap.
INITIAL_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


def is_db_unavailable(exc: BaseException) -> bool:
    """The database cannot be reached or dropped us (server restarting, connection refused or
    killed, no pool connection free, lock/statement timeout): worth retrying. Constraint
    violations, bad SQL and protocol refusals are not."""
    if isinstance(exc, (sa_exc.DisconnectionError, sa_exc.TimeoutError)):
        return True
    if isinstance(exc, sa_exc.DBAPIError):
        return exc.connection_invalidated or isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError))
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


def brief(exc: BaseException) -> str:
    """The first line of an error, without SQLAlchemy's background links."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return f"{type(orig).__name__}: {text[0] if text else ''}".strip()


class Outage:
    """State of one dependency as seen by one process: up, or down since when. Logs the two
    transitions (WARNING down, INFO back), counts outages and their total length (for metrics
    and status lines)."""

    def __init__(self, what: str, logger: logging.Logger):
        self.what, self.log = what, logger
        self.since: float | None = None  # monotonic time the current outage started
        self.count = 0
        self.total_s = 0.0  # finished outages
        self._lock = threading.Lock()  # request threads of the API share one watch

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException, retry_in: float | None = None) -> None:
        with self._lock:
            first = self.since is None
            if first:
                self.since = time.monotonic()
                self.count += 1
        if first:
            self.log.warning("%s unavailable (%s); retrying until it is back", self.what, brief(exc))
        else:
            self.log.debug("%s still unavailable (%s); next try in %.2fs", self.what, brief(exc), retry_in or 0.0)

    def ok(self) -> None:
        if self.since is None:  # the common case, without the lock
            return
        with self._lock:
            if self.since is None:
                return
            lasted = time.monotonic() - self.since
            self.total_s += lasted
            self.since = None
        self.log.warning("%s is back after %.1fs", self.what, lasted)

    def before_sleep(self, state: RetryCallState) -> None:
        """tenacity hook: one attempt failed with an outage."""
        exc = state.outcome.exception() if state.outcome is not None else None
        assert exc is not None  # tenacity sleeps only after a failed attempt
        self.failed(exc, state.upcoming_sleep)


def retrying(
    outage: Outage,
    retryable: Callable[[BaseException], bool] = is_db_unavailable,
    *,
    retry_for: float | None = None,
    stopping: Callable[[], bool] | None = None,
    initial: float = INITIAL_BACKOFF_S,
    cap: float = MAX_BACKOFF_S,
    before_sleep: Callable[[RetryCallState], Any] | None = None,
) -> Retrying:
    """A tenacity controller: retries `retryable` errors with capped, jittered exponential
    backoff, forever (`retry_for=None`) or for `retry_for` seconds, or until `stopping()`;
    then re-raises the last error. Use as ``for attempt in retrying(...): with attempt: ...``
    and call ``outage.ok()`` after a success."""
    stop: Any = stop_never if retry_for is None else stop_after_delay(retry_for)
    if stopping is not None:
        stop = stop | (lambda _state: stopping())

    def hook(state: RetryCallState) -> None:
        outage.before_sleep(state)
        if before_sleep is not None:
            before_sleep(state)

    return Retrying(
        retry=retry_if_exception(retryable),
        wait=wait_exponential_jitter(multiplier=initial, max=cap, jitter=initial),
        stop=stop,
        before_sleep=hook,
        reraise=True,
    )
