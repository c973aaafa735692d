"""The one place protocol transactions run: join the transaction the caller passes (`conn=`),
else open one, and retry it whole when PostgreSQL picks it as a deadlock victim or a
serialization failure (SQLSTATE 40P01 / 40001); plus request-id idempotency (ENGINEERING
pattern 5), used alike by the protocol methods that take a `request_id` and by the API's
`Idempotency-Key`.

Idempotency semantics: the outcome of a keyed request is stored in the same transaction as
its write, under the operation and a digest of the request body. The same key again returns
the stored outcome without running anything; the same key with another body (or for another
operation) is refused with `KeyReused` (409 `idempotency_key_reused`). The key is locked first
in the transaction: a concurrent duplicate waits for the first to commit, then replays its
outcome: one application, equal answers.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from tenacity import RetryCallState

from workers import retry
from workers.retry import Policy

from . import queries
from .errors import Conflict

T = TypeVar("T")
P = ParamSpec("P")
log = logging.getLogger("staleflow.tx")

# Transient failures: the whole transaction may simply run again.
RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})  # deadlock_detected, serialization_failure


class KeyReused(Conflict):
    code = "idempotency_key_reused"


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) in RETRYABLE_SQLSTATES


TRANSACTION_CONFLICT = retry.TRANSACTION_CONFLICT.but(retryable=is_retryable)
"""A transaction run again whole after a deadlock or serialization failure (full jitter, so the
colliding transactions drift apart)."""


def _note(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    log.info("transaction retried after %s (attempt %d)", sqlstate, state.attempt_number)


def retried(attempt: Callable[[], T], policy: Policy = TRANSACTION_CONFLICT) -> T:
    """Call `attempt` (one whole transaction) again after a deadlock or serialization failure,
    as `policy` waits and gives up (then the last error is raised).

    The first try runs without tenacity, whose machinery cost ~20 us per transaction (a tenth of
    a heartbeat's data-layer CPU); a conflict hands over to it with that failure as its first
    attempt, so the waits, the attempts and the log are the policy's as before."""
    try:
        return attempt()
    except Exception as exc:
        if policy.retryable is None or not policy.retryable(exc):
            raise
        failed: Exception | None = exc

    def again() -> T:
        nonlocal failed
        if failed is not None:
            first, failed = failed, None
            raise first
        return attempt()

    result: T = policy.retrying(before_sleep=_note)(again)
    return result


@contextmanager
def within(engine: Engine, conn: Connection | None) -> Iterator[Connection]:
    """The caller's transaction `conn`, else a new one (committed when the block ends)."""
    if conn is not None:
        yield conn
        return
    with engine.begin() as new:
        yield new


@contextmanager
def statements(engine: Engine, conn: Connection | None) -> Iterator[Connection]:
    """The caller's transaction `conn`, else a connection in autocommit: each statement its own
    transaction, without the BEGIN and COMMIT round trips (psycopg sends BEGIN apart from the
    first statement): a heartbeat is 1 round trip, not 4, ~200 us of client CPU, not ~450."""
    if conn is not None:
        yield conn
        return
    with engine.connect() as new:
        yield new.execution_options(isolation_level="AUTOCOMMIT")


def transactional(fn: Callable[P, T]) -> Callable[P, T]:
    """A protocol method that is one transaction: with `conn=` it runs in the caller's
    transaction (whose runner retries the whole); without, it is the outermost one and runs
    again whole after a deadlock or serialization failure. The method opens its transaction
    with `within(engine, conn)`.

    An instance attribute `observe_transaction` (operation name -> context manager) times the outermost
    call, retries included: the API's /metrics hooks in here without this package knowing it."""

    @functools.wraps(fn)
    def method(*args: P.args, **kw: P.kwargs) -> T:
        if kw.get("conn") is not None:
            return fn(*args, **kw)
        observe = getattr(args[0], "observe_transaction", None) if args else None
        if observe is None:
            return retried(lambda: fn(*args, **kw))
        with observe(fn.__name__):
            return retried(lambda: fn(*args, **kw))

    return method


def transaction(engine: Engine, body: Callable[[Connection], T], conn: Connection | None = None) -> T:
    """Run `body` in the caller's transaction `conn` when given (its outermost runner retries),
    else in a new one, retried whole on deadlock / serialization failure."""
    if conn is not None:
        return body(conn)

    def attempt() -> T:
        with within(engine, None) as new:
            return body(new)

    return retried(attempt)


def digest(body: Any) -> str:
    """A short fingerprint of a request body (bytes, str, or JSON-serialisable data)."""
    if isinstance(body, str):
        body = body.encode()
    elif not isinstance(body, bytes):
        from .protocol.core import dumps  # dataclasses and enums as plain JSON

        body = dumps(body).encode()
    return hashlib.sha256(body).hexdigest()[:16]


def once(
    engine: Engine,
    key: str | None,
    operation: str,
    body_digest: str,
    call: Callable[[Connection], T],
    encode: Callable[[T], str],
    decode: Callable[[Any], T],
    store: Callable[[T], bool] | None = None,
    conn: Connection | None = None,
    idle: Callable[[Connection], T | None] | None = None,
) -> tuple[T, bool]:
    """Run `call` in one transaction (the caller's `conn`, else a new one) together with the
    stored outcome of `key`; returns (outcome, replayed). Outcomes `store` rejects (an empty
    long-poll) are not kept: repeating them is harmless and they would only fill the table.
    Without `store` every outcome is kept.

    `idle` (without `conn`): a read sent first on the transaction's connection in autocommit,
    one round trip, that returns the outcome when it can tell that `call` would have nothing
    to do and `store` would reject it (an empty long-poll re-check: `RolloutOps.poll_idle`),
    else None, and then the transaction runs on that same connection (no second checkout)."""
    op = f"{operation}#{body_digest}"

    def body(conn: Connection) -> tuple[T, bool]:
        if key is None:
            return call(conn), False
        # Requests with this key are serialized before anything else is locked (so this wait
        # never happens inside another lock order): a concurrent duplicate waits for the first
        # to commit and then reads its stored outcome. Lock and lookup are one round trip
        # (migration 0006), on every re-check of a long-poll too.
        row = conn.execute(queries.text("idempotency_lookup"), {"k": key}).first()
        if row is not None:
            if row.operation != op:
                used = row.operation.split("#")[0]
                raise KeyReused([(0, f"request id {key!r} was already used for another request ({used})")])
            return decode(row.response), True
        outcome = call(conn)
        # The outcome is written once, when known: no placeholder row to update, and an outcome
        # `store` rejects (an empty long-poll) writes nothing, so its commit waits for no WAL flush.
        if store is None or store(outcome):
            kept = conn.execute(
                queries.text("idempotency_store"),
                {"r": key, "o": op, "resp": encode(outcome)},
            ).rowcount
            if not kept:  # only a writer that skips the lock could get here (code before 0006)
                raise KeyReused([(0, f"request id {key!r} was used concurrently for another request")])
        return outcome, False

    if idle is None or conn is not None:
        return transaction(engine, body, conn)
    check = idle

    def attempt() -> tuple[T, bool]:
        with engine.connect() as c:
            # the isolation level is the DBAPI connection's autocommit flag: no round trip
            got = check(c.execution_options(isolation_level="AUTOCOMMIT"))
            if got is not None:
                return got, False
            c.commit()  # SQLAlchemy's autobegun transaction, before the level changes (no round trip)
            c.execution_options(isolation_level=engine.dialect.default_isolation_level)
            with c.begin():
                return body(c)

    return retried(attempt)


def prune(engine: Engine, ttl_seconds: float, batch: int = 10_000) -> int:
    """Delete stored outcomes older than `ttl_seconds` (they outlive any retry by far), at most
    `batch` of them; returns how many."""
    with engine.begin() as conn:
        return conn.execute(queries.text("idempotency_prune"), {"ttl": ttl_seconds, "n": batch}).rowcount
