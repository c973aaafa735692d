"""Group commit in the API: concurrent small writes (lease renewals, segment reports, rewards)
of many instances and workers, coalesced into one database transaction per group
(`staleflow_db.group_commit`).

Leader/follower, without a timer: a call that finds no group in flight runs one at once (a
lone call on an idle server is a group of one, delayed by nothing); calls that arrive while a
group's transaction is in flight queue up, and when it commits the first of them leads the
next group, of everything queued by then (at most `max_items`). `lanes` groups may be in
flight at once per process; `window` (default 0) makes a leader wait that long for company.

Every caller gets its own outcome, as its own transaction would have given it: its value, or
the exception it raised (a refusal, only this item's), or the failure of the whole group
(backend killed, connection lost: each caller's 503, nothing of the group committed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import Connection

from staleflow_db import group_commit, idempotency
from staleflow_db.group_commit import Item, Outcome

from .metrics import Metrics
from .service import ApiProtocol, _digest

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class _Caller:
    __slots__ = ("item", "outcome", "done")

    def __init__(self, item: Item):
        self.item = item
        self.outcome: Outcome | None = None
        self.done = threading.Event()  # set with its outcome, or without one: lead the next group


class GroupCommit:
    """The API's writes that may share a transaction. With `enabled` false each call is its
    own transaction, exactly as `ApiProtocol` runs it."""

    def __init__(
        self,
        protocol: ApiProtocol,
        metrics: Metrics | None = None,
        *,
        enabled: bool = False,
        window: float = 0.0,
        max_items: int = 32,
        lanes: int = 4,
    ):
        if not 1 <= max_items <= group_commit.MAX_ITEMS:
            raise ValueError(f"max_items must be in 1..{group_commit.MAX_ITEMS}")
        self.protocol, self.metrics = protocol, metrics
        self.enabled, self.window, self.max_items, self.lanes = enabled, window, max_items, lanes
        self._mutex = threading.Lock()
        self._queue: list[_Caller] = []
        self._leaders = 0

    # ---- the calls -------------------------------------------------------------------------

    def once(
        self,
        key: str | None,
        operation: str,
        body: BaseModel | None,
        call: Callable[[Connection], M],
        model: type[M],
        order: tuple[int, int],
    ) -> tuple[M, bool]:
        """`ApiProtocol.once` (the stored outcome of `key` with `call`'s write), as an item of a
        group in lock order `order` (`staleflow_db.group_commit.run_lock`, `.instance` ...)."""
        if not self.enabled:
            return self.protocol.once(key, operation, body, call, model)
        digest = _digest(key, body)
        engine = self.protocol.engine

        def apply(conn: Connection) -> tuple[M, bool]:
            with self.protocol._timed(operation):
                return idempotency.once(
                    engine, key, operation, digest, call, lambda o: o.model_dump_json(), model.model_validate, conn=conn
                )

        result: tuple[M, bool] = self.submit(Item(apply, order))
        return result

    def write(
        self, operation: str, call: Callable[[Connection | None], T], order: tuple[int, int], *, ephemeral: bool = False
    ) -> T:
        """`call(conn)`, a protocol method given its transaction as `conn=` (None: its own,
        when coalescing is off), as an item of a group in lock order `order`."""
        if not self.enabled:
            return call(None)

        def apply(conn: Connection) -> T:
            with self.protocol._timed(operation):
                return call(conn)

        result: T = self.submit(Item(apply, order, ephemeral))
        return result

    # ---- leader / follower -----------------------------------------------------------------

    def submit(self, item: Item) -> Any:
        """Queue `item`, wait for its group to commit (leading a group if none is in flight),
        and return its value or raise its error."""
        me = _Caller(item)
        with self._mutex:
            self._queue.append(me)
            lead = self._leaders < self.lanes
            if lead:
                self._leaders += 1
        if self.metrics is not None:
            self.metrics.group_queued.inc()
        try:
            if not lead:
                me.done.wait()
            if me.outcome is None:  # leading: a new group, or handed the lead by the last one
                self._lead()
        finally:
            if self.metrics is not None:
                self.metrics.group_queued.dec()
        assert me.outcome is not None
        if me.outcome.error is not None:
            raise me.outcome.error
        return me.outcome.value

    def _lead(self) -> None:
        """Run one group: the queue's head (this caller: a new leader found the queue empty, a
        handed-over one is at its head) and whoever queued behind it."""
        group: list[_Caller] = []
        try:
            if self.window > 0:
                time.sleep(self.window)
            with self._mutex:
                group = self._queue[: self.max_items]
                del self._queue[: self.max_items]
            try:
                outcomes = group_commit.apply_group(self.protocol.engine, [c.item for c in group])
            except BaseException as exc:  # the transaction failed as a whole: every caller's error
                outcomes = [Outcome(error=exc) for _ in group]
                if not isinstance(exc, Exception):
                    raise
            finally:
                if self.metrics is not None and group:
                    self.metrics.group_calls.observe(len(group))
            for c, o in zip(group, outcomes, strict=True):
                c.outcome = o
        finally:
            for c in group:
                if c.outcome is None:
                    c.outcome = Outcome(error=RuntimeError("group commit interrupted"))
            with self._mutex:
                successor = self._queue[0] if self._queue else None
                if successor is None:
                    self._leaders -= 1  # else the lane passes on to it: _leaders stays
            for c in group:
                c.done.set()
            if successor is not None:
                successor.done.set()
