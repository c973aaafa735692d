"""Every retry of StaleFlow's processes, as named policies built on tenacity.

A :class:`Policy` says how long to wait between attempts (`initial` seconds, doubling up to
`cap`, plus up to `jitter` seconds of random jitter; `initial == cap` waits a fixed time; with
`full_jitter`, a uniform random time up to that doubling wait instead) and how long to keep trying (`retry_for` seconds, None for ever, or `attempts` at most). What is
worth retrying is the caller's: an error predicate (`retryable`, which a policy may carry) or a
result that is not yet good enough (`until`). Anything else -- a refusal, a bug -- is raised at
once.

Riding through an outage of a dependency (the database, the API, the parameter server): an
:class:`Outage` logs one line when the dependency goes away and one when it is back (retries in
between log at debug level only). Every long-running process retries outages for ever,
one-shot commands for a bounded time.

Database-free (standard library and tenacity): workers import it on nodes without the server
stack; staleflow_db/retry.py adds which database errors are outages.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_result,
    retry_never,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
)
from tenacity.wait import wait_base, wait_exponential_jitter, wait_random_exponential


@dataclass(frozen=True)
class Policy:
    """How one kind of retry waits and when it gives up (module docstring)."""

    name: str
    initial: float  # first wait, seconds
    cap: float  # longest wait
    jitter: float = 0.0  # random seconds added to each wait, at most
    retry_for: float | None = None  # give up after this long; None: never
    attempts: int | None = None  # give up after this many attempts (the first included)
    retryable: Callable[[BaseException], bool] | None = None  # errors worth another try
    # Full jitter: wait uniformly between 0 and the doubling wait, so that clients that
    # collided (deadlocked transactions) drift apart rather than collide again in step.
    full_jitter: bool = False

    def __post_init__(self) -> None:
        if self.full_jitter and self.jitter:
            raise ValueError(f"retry policy {self.name!r}: full jitter replaces `jitter`; give one")

    def but(self, **changes: Any) -> Policy:
        """This policy with some fields changed (settings and options that tune it)."""
        return dataclasses.replace(self, **changes)

    def wait(self) -> wait_base:
        if self.full_jitter:
            return wait_random_exponential(multiplier=self.initial, max=self.cap)
        return wait_exponential_jitter(multiplier=self.initial, max=self.cap, jitter=self.jitter)

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt number `attempt` (1 for the first), for loops that
        sleep themselves (e.g. a supervisor restarting a process)."""
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt
        return self.wait()(state)

    def _kwargs(
        self,
        outage: Outage | None,
        retryable: Callable[[BaseException], bool] | None,
        until: Callable[[Any], bool] | None,
        stopping: Callable[[], bool] | None,
        before_sleep: Callable[[RetryCallState], Any] | None,
        give_up: Callable[[RetryCallState], Any] | None,
    ) -> dict[str, Any]:
        retryable = retryable or self.retryable
        if retryable is None and until is None:
            raise TypeError(f"retry policy {self.name!r}: nothing to retry on (no retryable, no until)")
        retry: Any = retry_never
        if retryable is not None:
            retry = retry | retry_if_exception(retryable)
        if until is not None:
            good = until
            retry = retry | retry_if_result(lambda result: not good(result))
        stop: Any = stop_never if self.retry_for is None else stop_after_delay(self.retry_for)
        if self.attempts is not None:
            stop = stop | stop_after_attempt(self.attempts)
        if stopping is not None:
            asked = stopping
            stop = stop | (lambda _state: asked())

        def hook(state: RetryCallState) -> None:
            if outage is not None:
                outage.before_sleep(state)
            if before_sleep is not None:
                before_sleep(state)

        kw: dict[str, Any] = dict(retry=retry, wait=self.wait(), stop=stop, before_sleep=hook, reraise=True)
        if give_up is not None:
            kw["retry_error_callback"] = give_up
        return kw

    def retrying(
        self,
        outage: Outage | None = None,
        retryable: Callable[[BaseException], bool] | None = None,
        *,
        until: Callable[[Any], bool] | None = None,
        stopping: Callable[[], bool] | None = None,
        before_sleep: Callable[[RetryCallState], Any] | None = None,
        give_up: Callable[[RetryCallState], Any] | None = None,
    ) -> Retrying:
        """A tenacity controller: retries errors for which `retryable` (else the policy's own)
        holds, and results for which `until` does not, until the policy gives up or
        `stopping()`; then re-raises the last error, or calls `give_up` (whose return value, or
        exception, is the call's). `outage`, if given, hears of each failed attempt (call its
        ``ok()`` after a success). Use as ``for attempt in policy.retrying(...): with attempt:
        ...`` or ``policy.retrying(...)(fn)``."""
        return Retrying(**self._kwargs(outage, retryable, until, stopping, before_sleep, give_up))

    def async_retrying(
        self,
        outage: Outage | None = None,
        retryable: Callable[[BaseException], bool] | None = None,
        *,
        until: Callable[[Any], bool] | None = None,
        stopping: Callable[[], bool] | None = None,
        before_sleep: Callable[[RetryCallState], Any] | None = None,
        give_up: Callable[[RetryCallState], Any] | None = None,
    ) -> AsyncRetrying:
        """:meth:`retrying` for coroutines (``async for attempt in ...``, or ``await ctl(fn)``)."""
        return AsyncRetrying(**self._kwargs(outage, retryable, until, stopping, before_sleep, give_up))


def any_error(exc: BaseException) -> bool:
    """Every Exception is worth another try (not KeyboardInterrupt, SystemExit, cancellation)."""
    return isinstance(exc, Exception)


# ---- the named policies ------------------------------------------------------------------------
# Outages: the first retry after 50 ms, doubling to 1 s: an outage of a few seconds is noticed
# within ~1 s of its end, and a long one costs one attempt per second.

API_OUTAGE = Policy("API outage", initial=0.05, cap=1.0, jitter=0.05, retry_for=60.0)
"""The REST client through connection errors and 502/503/504 (ClientSettings tune it)."""

PARAM_SERVER = Policy("parameter server outage", initial=0.05, cap=1.0, jitter=0.05)
"""The parameter-server client through a PS that is down or restarting (its `retry_for`)."""

DATABASE_OUTAGE = Policy("database outage", initial=0.05, cap=1.0, jitter=0.05)
"""Database work through an outage, for ever; staleflow_db.retry.DATABASE_OUTAGE adds which
errors are outages."""

DATABASE_PROBE = Policy("database probe", initial=0.5, cap=0.5, retryable=any_error)
"""The API's probe of a database it saw go down, every STALEFLOW_API_PROBE_INTERVAL until it answers."""

LISTEN_RECONNECT = Policy("notification listener reconnect", initial=0.1, cap=1.0, jitter=0.1, retryable=any_error)
"""The API's LISTEN connection, reconnected after a loss (a fresh backoff per loss)."""

PS_FIRST_VERSION = Policy("first committed version", initial=0.5, cap=0.5)
"""A rollout worker waiting for the PS to serve a committed version (--ps-wait seconds)."""

READY = Policy("ready poll", initial=0.1, cap=0.1)
"""Polling until something is ready (a process answers, a file appears, the embedded server
accepts connections): a fixed interval."""

RESTART = Policy("process restart", initial=1.0, cap=30.0)
"""A supervisor restarting a process that exited, 1 s doubling to 30 s (ray actors)."""

TRANSACTION_CONFLICT = Policy("transaction conflict", initial=0.01, cap=0.32, full_jitter=True, attempts=6)
"""A whole transaction run again after PostgreSQL chose it as a deadlock victim or failed it for
serialization: 5 retries, full jitter up to 10 ms doubling to 320 ms; staleflow_db.idempotency
adds which errors those are."""

SERVER_PORT_TAKEN = Policy("embedded server port taken", initial=0.0, cap=0.0, attempts=3)
"""Starting the embedded PostgreSQL again at once on another port when another program took
the chosen one between the check and the bind (three tries)."""

REWARD_CALL = Policy("reward call", initial=0.2, cap=5.0, jitter=0.1, attempts=3, retryable=any_error)
"""A reward function or service that raised, returned no valid reward or timed out: 3 tries
in all (`--reward-retries` tunes it), 0.2 s doubling between them; then the sample is dropped
as reward_failed."""


# ---- outages -----------------------------------------------------------------------------------


def brief(exc: BaseException) -> str:
    """The first line of an error (of the driver's error it wraps, if any: without SQLAlchemy's
    background links)."""
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
