"""Group commit: the small writes of many callers (lease renewals, segment reports, rewards)
applied in ONE transaction, each under its own SAVEPOINT, so that a refused item refuses only
itself and every caller gets exactly the outcome its own transaction would have given.

Savepoints cost two round trips and a subtransaction per item, and refusals are rare: a group
runs first without them, and only when an item refuses is it rolled back whole and run again,
each item under its savepoint (a group of one is then simply its own refused transaction).
Outcomes are those of the run that committed.

Items run in lock order (`Item.order`): the run lock first (rewards, by run id), then the
instances (reports, then heartbeats, by instance id), the order the protocol's own
transactions take them in (runs -> instances -> samples). Heartbeats come last: their exclusive
row lock on the instance is then held the shortest.

A refusal (a protocol error, a lock or statement timeout, a value the database refuses) rolls
its item back to its savepoint and the group goes on. A failure of the transaction itself
fails the whole group: a deadlock or serialization failure reruns it whole (nothing of it was
committed), anything else (backend killed, connection lost) is raised to every caller, as each
one's own transaction would have raised it. Nothing of an item is ever committed without the
rest of it: an item is applied whole in its savepoint or rolled back to it.

A group holds one subtransaction per item until it commits, and PostgreSQL keeps the ids of
only 64 of them per backend in shared memory before every snapshot in the cluster gets slower
(subxid overflow): groups stay below `MAX_ITEMS`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine

from . import queries
from .idempotency import is_retryable, retried

MAX_ITEMS = 60  # subtransactions per group: below PostgreSQL's 64 cached per backend

# Item.order's first element: which lock an item takes first
RUN_LOCK, INSTANCE, INSTANCE_LAST = 0, 1, 2


@dataclass(frozen=True)
class Item:
    """One caller's write: `apply` runs it in the group's transaction (the `conn=` of a
    protocol call). `order`: its place in the lock order (`run_lock`, `instance` ...).
    `ephemeral`: it asks for no synchronous commit (a heartbeat): the group commits
    asynchronously only when every applied item is ephemeral."""

    apply: Callable[[Connection], Any]
    order: tuple[int, int]
    ephemeral: bool = False


def run_lock(run_id: int) -> tuple[int, int]:
    """The order of an item that takes the run's lock (record_rewards)."""
    return (RUN_LOCK, run_id)


def instance(instance_id: int) -> tuple[int, int]:
    """The order of an item fenced by its instance's lease (a segment report)."""
    return (INSTANCE, instance_id)


def lease(instance_id: int) -> tuple[int, int]:
    """The order of a lease renewal (a heartbeat): after every other item."""
    return (INSTANCE_LAST, instance_id)


class _Refused(Exception):
    """An item refused in a group run without savepoints: the group runs again with them."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


@dataclass
class Outcome:
    """An item's result, or what it raised (then `value` is None)."""

    value: Any = None
    error: BaseException | None = None


def apply_group(engine: Engine, items: Sequence[Item]) -> list[Outcome]:
    """Apply `items` in one transaction, each in its own savepoint; their outcomes in the
    order given. Raises when the transaction itself fails (after rerunning it whole on a
    deadlock or serialization failure): no item of it was committed then."""
    if len(items) > MAX_ITEMS:
        raise ValueError(f"a group holds at most {MAX_ITEMS} items, not {len(items)}")
    order = sorted(range(len(items)), key=lambda i: items[i].order)

    def attempt() -> list[Outcome]:
        try:
            return run(savepoints=False)
        except _Refused as refused:
            if len(items) == 1:  # its own transaction, rolled back: its own refusal
                return [Outcome(error=refused.error)]
        return run(savepoints=True)

    def run(savepoints: bool) -> list[Outcome]:
        outcomes = [Outcome() for _ in items]
        with engine.begin() as conn:
            durable = False
            for i in order:
                savepoint = conn.begin_nested() if savepoints else None
                try:
                    outcomes[i].value = items[i].apply(conn)
                except Exception as exc:
                    # a deadlock victim reruns whole; a lost connection fails the whole group
                    if is_retryable(exc) or conn.invalidated:
                        raise
                    if savepoint is None:
                        raise _Refused(exc) from exc  # rolled back whole: again, with savepoints
                    try:
                        savepoint.rollback()
                    except Exception:
                        raise exc from None  # the transaction is unusable: the item's error for all
                    outcomes[i].error = exc
                else:
                    if savepoint is not None:
                        savepoint.commit()
                    durable = durable or not items[i].ephemeral
            if durable and any(it.ephemeral for it in items):
                # an ephemeral item's SET LOCAL synchronous_commit=off must not make the
                # others' commit asynchronous
                conn.execute(queries.text("group_commit_durable"))
        return outcomes

    return retried(attempt)
