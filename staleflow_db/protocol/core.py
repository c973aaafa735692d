"""The core every capability of the protocol stands on (docs/protocol.md): the per-run lock and
its buffer accounting (counters, reservations, releases with their cascade, the batched flush),
drops and their commands, the fences (an instance's lease, a route's route token, the
coordinator's epoch), the prompt groups' creation, the per-call limits, and the capability
classes' access to transactions and request-id idempotency (`staleflow_db.idempotency`).

What two capabilities share lives here; a capability module imports only this core (and
`events`, `driver`), never another capability's module."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine

from workers.wire.enums import DropReason, RunState
from workers.wire.run_config import CONFIG_FIELDS, RunConfig

from .. import idempotency, queries
from ..errors import Conflict, InvalidInput, NotFound, RunNotActive, TooLarge
from ..rules import BufferCounts, Limits, Reservation, apply_moves, cascade_moves
from ..types import Report
from . import driver
from .events import Event, events_params, log_events


def dumps(value: Any) -> str:
    def default(o: Any) -> Any:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return dataclasses.asdict(o)
        if isinstance(o, enum.Enum):
            return o.value
        raise TypeError(f"cannot serialise {type(o).__name__}")

    return json.dumps(value, default=default, separators=(",", ":"))


@dataclass(frozen=True, kw_only=True)
class RunRow(RunConfig):
    """A run as the protocol reads it: its configuration (`RunConfig`, the one definition of
    its fields), its id, its version and its lifecycle state (a derived view, no field of its
    own but these three)."""

    id: int
    version: int
    state: str = RunState.ACTIVE.value

    @property
    def limits(self) -> Limits:
        return self

    @property
    def config(self) -> RunConfig:
        """Its configuration alone."""
        return RunConfig(**{f: getattr(self, f) for f in CONFIG_FIELDS})

    @classmethod
    def of(cls, row: Mapping[Any, Any]) -> RunRow:
        """From a row or JSON object that holds the run's columns among others."""
        return cls(**{c: row[c] for c in RUN_COLUMNS})


# The run's columns as the named queries select them (load_run, list_runs, snapshot ...):
# tests/unit/test_run_config.py checks them against the queries and the `runs` table.
RUN_COLUMNS: tuple[str, ...] = ("id", "version", "state", *CONFIG_FIELDS)


def load_run(conn: Connection, run_id: int, *, lock: bool) -> RunRow:
    # NO KEY UPDATE, not UPDATE: it serializes run-locked transactions just the same, but
    # leaves FOR KEY SHARE free, which every FK check on runs (an event or sample insert by
    # report, claim, heartbeat ...) takes. FOR UPDATE made those wait for the run lock, and
    # deadlock: report holds sample locks -> waits on runs; route holds runs -> waits on them.
    row = conn.execute(queries.text("load_run_locked" if lock else "load_run"), {"run": run_id}).first()
    if row is None:
        raise NotFound(f"run {run_id}")
    return RunRow(**row._mapping)


def check_state(run: RunRow, doing: str, *, paused_ok: bool = True) -> None:
    """A cancelled run refuses `doing` (409 naming its state); a paused one too unless
    `paused_ok` (consume and publish: in-flight work may finish and train)."""
    if run.state == RunState.CANCELLED or (run.state == RunState.PAUSED and not paused_ok):
        hint = " (`staleflow run resume` resumes it)" if run.state == RunState.PAUSED else ""
        raise RunNotActive(run.id, f"run {run.id} is {run.state}: {doing} refused{hint}")


def read_buffers(conn: Connection, run_id: int, first: int) -> list[BufferCounts]:
    """The run's buffers from index `first` on, in order."""
    rows = conn.execute(queries.text("read_buffers"), {"run": run_id, "first": first}).all()
    return [BufferCounts(r.idx, r.occupied, r.reserved, r.consumed) for r in rows]


@dataclass(frozen=True)
class LockedRead:
    """A read that runs right after the run lock is granted, in the same round trip
    (`RunTx.open`): the named query `name` gets the run as :run and `params` (lists, typed by
    the casts the query has), and returns one jsonb."""

    name: str
    params: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
    # named queries sent between the run lock and the read, with the read's parameters (the
    # group locks of route and record_rewards): the read's snapshot then follows their locks too
    locks: tuple[str, ...] = ()

    def statement(self, run_id: int, name: str | None = None) -> tuple[str, dict[str, Any]]:
        """The read (or its lock `name`) as a statement of its own (`driver.scalars`)."""
        return queries.pyformat(name or self.name), {"run": run_id, **{k: list(v) for k, v in self.params.items()}}

    def statements(self, run_id: int) -> list[tuple[str, dict[str, Any]]]:
        """Its locks, then the read."""
        return [*(self.statement(run_id, lock) for lock in self.locks), self.statement(run_id)]


class RunTx:
    """One transaction holding the run's lock: every change to buffer accounting of a run is
    serialized here (a global budget, so no SKIP LOCKED), and flushed in batched statements."""

    def __init__(self, conn: Connection, run: RunRow, buffers: list[BufferCounts] | None = None):
        self.conn, self.run = conn, run
        if buffers is None:
            buffers = read_buffers(conn, run.id, run.version)
        self.buffers = {b.index: b for b in buffers}
        self._original = {b: (c.occupied, c.reserved) for b, c in self.buffers.items()}
        self._reservations: dict[int, Reservation] | None = None
        self.moved: dict[int, int] = {}  # group -> new reserved buffer, from cascades
        self.events: list[Event] = []
        self._deferred: list[tuple[str, dict[str, Any], set[int]]] = []
        self._read: tuple[str, Any] | None = None

    @classmethod
    def open(
        cls,
        conn: Connection,
        run_id: int,
        read: LockedRead | None = None,
    ) -> RunTx:
        """Lock the run and read it with its buffers in one round trip: the function reads the
        buffers in a statement of its own, so under READ COMMITTED they include the commit of
        the lock's previous holder (a single statement that waited for the lock would read them
        from the snapshot it started with). `read`: the caller's locking read, sent in that same
        round trip as the next statement (`driver.scalars`: it runs once the lock is granted,
        from a snapshot of its own, and is planned once per connection); its result is taken
        with `locked_read`."""
        if read is None:
            got = conn.execute(queries.text("lock_run"), {"run": run_id}).scalar()
        else:
            lock = [(queries.pyformat("lock_run"), {"run": run_id})]
            got, *_, result = driver.scalars(conn, [*lock, *read.statements(run_id)])
        if got is None:
            raise NotFound(f"run {run_id}")
        rtx = cls(conn, RunRow.of(got["run"]), [BufferCounts(i, o, r, c) for i, o, r, c in got["buffers"]])
        if read is not None:
            rtx._read = (read.name, result)
        return rtx

    def preset_read(self, read: LockedRead, result: Any) -> None:
        """`read`'s result, read by the caller (a fast path, without the run lock)."""
        self._read = (read.name, result)

    def changed_buffers(self) -> list[BufferCounts]:
        """The buffers whose counters this transaction changed (the flush writes them)."""
        return [c for b, c in self.buffers.items() if self._original.get(b) != (c.occupied, c.reserved)]

    def locked_read(self, read: LockedRead) -> Any:
        """The result of `read`: sent with the lock by `open` if it was given there, else now
        (a caller that locked the run first, e.g. a coordinator cycle checking its epoch)."""
        if self._read is not None and self._read[0] == read.name:
            got, self._read = self._read[1], None
            return got
        return driver.scalars(self.conn, read.statements(self.run.id))[-1]

    def buffer(self, idx: int) -> BufferCounts:
        return self.buffers.setdefault(idx, BufferCounts(idx))

    # ---- reservations ----------------------------------------------------------------------

    def reservations(self) -> dict[int, Reservation]:
        """The run's reservations with each group's live version, computed from its members now
        (`rules.group_version`: aborted members and queued ones with no tokens do not count)."""
        if self._reservations is None:
            rows = self.conn.execute(queries.text("reservations"), {"run": self.run.id}).all()
            self.set_reservations(rows)
        assert self._reservations is not None
        return self._reservations

    def set_reservations(self, rows: Sequence[Sequence[Any]]) -> None:
        """The reservations as read by a caller's statement with `reservations` in it (one
        round trip less), from a snapshot taken while this transaction holds the run lock."""
        self._reservations = {g: Reservation(g, b, v) for g, b, v in rows}

    def add_reservation(self, group_id: int, buffer: int, version: int | None) -> None:
        self.buffer(buffer).reserved += 1
        if self._reservations is not None:
            self._reservations[group_id] = Reservation(group_id, buffer, version)

    def set_group_version(self, group_id: int, version: int | None) -> None:
        if self._reservations is not None and group_id in self._reservations:
            r = self._reservations[group_id]
            self._reservations[group_id] = Reservation(group_id, r.buffer, version)

    def release(self, group_id: int) -> None:
        """Give back a group's reservation; earlier reservations then move as late as they can."""
        self.cascade(self.unreserve(group_id))

    def unreserve(self, group_id: int) -> int:
        """Give back a group's reservation without a cascade; returns the buffer it held. Occupy
        places the group first and only then cascades, so no other group takes its slot."""
        res = self.reservations().pop(group_id)
        buffer = self.moved.pop(group_id, res.buffer)
        self.buffers[buffer].reserved -= 1
        return buffer

    def cascade(self, freed: int) -> None:
        """Earlier reservations move into the slot freed in buffer `freed` (`rules.cascade_moves`)."""
        self._record_moves(cascade_moves(freed, self.buffers, self.reservations().values(), self.run.limits))

    def apply_moves(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """Apply reservation moves planned on a copy of the counters (`rules.occupy_plan`)."""
        apply_moves(self.buffers, moves)
        self._record_moves(moves)

    def _record_moves(self, moves: Sequence[tuple[int, int, int]]) -> None:
        reservations = self.reservations()
        for gid, source, to in moves:
            reservations[gid] = Reservation(gid, to, reservations[gid].version)
            self.moved[gid] = to
            self.events.append(Event("reservation_moved", group=gid, buffer=to, data={"from": source}))

    def reserved_buffer(self, group_id: int) -> int:
        return self.reservations()[group_id].buffer

    # ---- writes ----------------------------------------------------------------------------

    def defer(self, name: str, params: dict[str, Any], groups: Sequence[int] = ()) -> None:
        """A data-modifying named query sent as a part of the flush instead of on its own
        round trip; its effect is not visible before the flush. `groups`: the prompt_groups
        rows it writes, which must not be moved reservations (one statement must not update a
        row twice). Deferred parts write disjoint rows."""
        p = f"x{len(self._deferred)}_"  # its parameters apart from the other parts'
        self._deferred.append((queries.prefixed(name, p), {p + k: v for k, v in params.items()}, set(groups)))

    def flush(self) -> None:
        """Persist counters, moved reservations, deferred group updates and the events as the
        parts of ONE statement (data-modifying CTEs): under the run lock every round trip is
        time every other run-locked transaction waits. The parts touch disjoint rows, so their
        sharing one snapshot changes nothing. Composed (`queries.with_parts`) because only the
        parts with something to write are sent: a fixed statement of every part would be
        planned in full, under the run lock, on every call."""
        parts: list[str] = []
        params: dict[str, Any] = {"run": self.run.id}
        changed = self.changed_buffers()
        if changed:
            parts.append(queries.sql("flush_buffers"))
            params.update(
                bs=self.run.batch_size,
                cap=self.run.buffer_capacity,
                idx=[c.index for c in changed],
                occ=[c.occupied for c in changed],
                res=[c.reserved for c in changed],
            )
            self._original.update({c.index: (c.occupied, c.reserved) for c in changed})
        if self.moved:
            parts.append(queries.sql("flush_moved"))
            params.update(mids=list(self.moved), mbs=list(self.moved.values()))
        for sql, extra, gids in self._deferred:
            assert not gids & self.moved.keys(), "a deferred group update overlaps a moved reservation"
            parts.append(sql)
            params.update(extra)
        if self.events:
            parts.append(queries.prefixed("events_insert", "e_"))
            params.update(events_params(self.run.id, self.events, "e_"))
        if parts:
            self.conn.execute(queries.composed(queries.with_parts(parts, queries.sql("flush_done"))), params)
        self.moved.clear()
        self._deferred.clear()
        self.events.clear()

    def drop_groups(self, group_ids: Sequence[int], state: str, reason: DropReason | str) -> list[int]:
        """Filter or abort groups (releasing reservations first) and abort their live members."""
        if not group_ids:
            return []
        reason = getattr(reason, "value", reason)
        for gid in group_ids:
            if gid in self.reservations():
                self.release(gid)
        self.conn.execute(queries.text("drop_groups"), {"ids": list(group_ids), "state": state, "reason": reason})
        self.events.extend(Event(f"group_{state}", group=g, data={"reason": reason}) for g in group_ids)
        return abort_members(self.conn, self.run.id, group_ids, reason, self.events)


class CommandTarget(NamedTuple):
    """A running sample a command is for: the instance running it, at this attempt."""

    sample_id: int
    instance_id: int
    attempt: int


def abort_members(
    conn: Connection, run_id: int, group_ids: Sequence[int], reason: str, events: list[Event]
) -> list[int]:
    """Abort every live member of the groups; running ones also get an abort command."""
    return abort_samples_where(conn, run_id, "group_id", group_ids, reason, events)


def abort_samples_where(
    conn: Connection, run_id: int, column: str, ids: Sequence[int], reason: str, events: list[Event]
) -> list[int]:
    """Abort the live samples whose `column` ("id" or "group_id") is in `ids`."""
    query = {"id": "abort_samples", "group_id": "abort_members"}[column]
    if not ids:
        return []
    rows = conn.execute(queries.text(query), {"ids": list(ids), "reason": reason}).all()
    running = [CommandTarget(r.id, r.instance_id, r.attempt) for r in rows if r.instance_id is not None]
    send_commands(conn, run_id, "abort", running)
    events.extend(Event("sample_aborted", sample=r.id, instance=r.instance_id, data={"reason": reason}) for r in rows)
    return [r.id for r in rows]


def send_commands(
    conn: Connection, run_id: int, kind: str, targets: Sequence[CommandTarget], epoch: int | None = None
) -> None:
    """Queue `kind` commands for running samples."""
    if not targets:
        return
    conn.execute(
        queries.text("send_commands"),
        {
            "run": run_id,
            "kind": kind,
            "epoch": epoch,
            "sids": [t.sample_id for t in targets],
            "insts": [t.instance_id for t in targets],
            "atts": [t.attempt for t in targets],
        },
    )


# ---- group locks and the fast paths ------------------------------------------------------
#
# The run lock is taken only when a group's buffer accounting changes. A reward batch that
# completes no reserved group, and a route batch whose members all join groups already reserved
# (at a version no lower than any live member's), change samples and events only: they go
# without the run lock (`scoring.rewards_fast`, `routing.route_fast`).
#
# What serializes the calls on one group instead is its group lock (`group_locks`: an advisory
# transaction lock per group, taken in group id order by EVERY route and record_rewards of its
# samples, before any sample lock, and right after the run lock when the call has one). The
# fast path's decision is taken by a statement run after those locks were granted, so it sees
# every route and reward of those groups committed before: of two reward batches that together
# complete a group, the second sees the first and takes the run lock; a member routed into a
# group is seen by the reward batch that places it (its surplus is aborted).
#
# Lock order: [run ->] group locks -> instances -> samples [-> groups]. A fast path holds no
# group row and waits for no group lock once it holds a sample, so it waits on no lock that a
# run-locked transaction takes after its own group locks: no new deadlock. What it does not
# lock (buffers, the run's version, other groups) changes only under the run lock, and none of
# those transactions reads what a fast path writes (a joining member lowers no group version,
# so no reservation's window shrinks; a live member stays live): a fast path is serialized
# before any run-locked transaction it overlaps. Its locks and decision run in a savepoint;
# when the call needs the run lock after all, the savepoint is rolled back (releasing the group
# locks, which must not be held while the run lock is awaited) in the run lock's round trip.
#
# The choice costs no round trip of its own (`lock_fast_or_run`): one statement evaluates an
# unlocked guess and takes either the group locks (the fast path) or the run lock and then the
# group locks, and marks which in the transaction-local setting staleflow.lock (`fast_locked`);
# the fast path's reads and the run-locked read follow it in the same round trip, each reading
# only on its own path. A batch bound for the run lock thus holds no group lock that run-locked
# calls would wait for while it turns around, and pays no attempt before the lock.


def fast_or_run_lock_sql(guess: str) -> str:
    """The lock statement of `lock_fast_or_run` (`:name` parameters): `lock_groups_fast` if
    :fast and the named query `guess` (one boolean, from the statement's snapshot, before any
    lock) say the fast path will do, else `lock_run_then_groups`. Only the branch the CASE
    takes runs (its subquery is evaluated when first needed)."""
    return (
        f"SELECT CASE WHEN CAST(:fast AS boolean) AND ({queries.sql(guess)})"
        f" THEN ({queries.sql('lock_groups_fast')}) ELSE ({queries.sql('lock_run_then_groups')}) END"
    )


def if_fast_sql(name: str) -> str:
    """The named query `name` (one value) only on the fast path (`fast_locked`), else NULL."""
    return f"SELECT CASE WHEN ({queries.sql('fast_locked')}) THEN ({queries.sql(name)}) END"


@functools.cache
def if_fast(name: str) -> str:
    """`if_fast_sql` in psycopg's form, built once."""
    return queries.to_pyformat(if_fast_sql(name))


@functools.cache
def fast_or_run_lock(guess: str) -> str:
    """`fast_or_run_lock_sql` in psycopg's form, built once."""
    return queries.to_pyformat(fast_or_run_lock_sql(guess))


FAST_SAVEPOINT = "staleflow_fast"
FAST_BEGIN: tuple[str, dict[str, Any]] = (f"SAVEPOINT {FAST_SAVEPOINT}", {})
FAST_KEEP: tuple[str, dict[str, Any]] = (f"RELEASE SAVEPOINT {FAST_SAVEPOINT}", {})
# A fast path whose decision, under its group locks, needs the run lock after all: the group
# locks are freed before the run lock is awaited. (On a ROLLBACK psycopg deallocates every
# prepared statement of the connection, so the reads are planned again; only this case pays it.)
FAST_UNDONE: tuple[tuple[str, dict[str, Any]], ...] = ((f"ROLLBACK TO SAVEPOINT {FAST_SAVEPOINT}", {}), FAST_KEEP)


@dataclass
class Locked:
    """What `lock_fast_or_run` took: the run lock (`rtx`, its locked read preset), or the fast
    path's group locks (`rtx` None) with the results of the fast reads sent after them."""

    rtx: RunTx | None
    fast: list[Any]


def lock_fast_or_run(
    conn: Connection,
    run_id: int,
    guess: str,
    read: LockedRead,
    fast_reads: Sequence[tuple[str, Mapping[str, Any]]] = (),
    *,
    fast: bool = True,
    prelude: Sequence[tuple[str, Mapping[str, Any]]] = (),
) -> Locked:
    """ONE round trip: a savepoint (with `fast`), the lock statement (`fast_or_run_lock_sql`
    with the named query `guess`, which gets `read`'s parameters), `fast_reads` (statements
    that read only on the fast path: `if_fast_sql`, or a one-time filter on `fast_locked`),
    and `read` (which reads only under the run lock). `fast` False: the run lock, whatever the
    guess (no savepoint, no fast reads); `prelude`: statements sent first (`FAST_UNDONE`).
    NotFound when the run lock was taken and there is no such run."""
    params = {**read.statement(run_id)[1], "fast": fast}
    lock = (fast_or_run_lock(guess), params)
    reads = list(fast_reads) if fast else []
    statements = [*prelude, *((FAST_BEGIN,) if fast else ()), lock, *reads, read.statement(run_id)]
    values = driver.scalars(conn, statements)
    got = values[len(statements) - len(reads) - 2]
    if got is not None and "groups" in got:
        return Locked(None, values[len(statements) - len(reads) - 1 : -1])
    if got is None:
        raise NotFound(f"run {run_id}")
    rtx = RunTx(conn, RunRow.of(got["run"]), [BufferCounts(i, o, r, c) for i, o, r, c in got["buffers"]])
    rtx.preset_read(read, values[-1])
    return Locked(rtx, [])


# ---- per-call limits ---------------------------------------------------------------------

MAX_BATCH = 10_000  # items per call: larger batches hold the run lock too long


def check_batch(items: Sequence[object], what: str) -> None:
    if len(items) > MAX_BATCH:
        raise TooLarge(f"{len(items)} {what} in one call (at most {MAX_BATCH})")


def check_unique(ids: Sequence[int], what: str, call: str) -> None:
    """InvalidInput naming the first id that appears twice in one batch."""
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise InvalidInput(f"{what} {i} appears twice in one {call} batch")
        seen.add(i)


def check_found(run_id: int, sample_ids: Sequence[int], found: set[int]) -> None:
    missing = [sid for sid in sample_ids if sid not in found]
    if missing:
        raise NotFound(f"sample {missing[0]} in run {run_id}")


# ---- fences ------------------------------------------------------------------------------


def check_live(instance_id: int, state: str, live: bool) -> None:
    """A fenced instance (not active, or its lease lapsed) is refused: it must register again."""
    if state != "active":
        raise Conflict([(instance_id, f"instance is {state}; register again")])
    if not live:
        raise Conflict([(instance_id, "instance lease expired; register again")])


def route_lost(r: Report, state: str, attempt: int, instance: int | None, token: Any, quoted: uuid.UUID) -> str | None:
    """Why a report does not hold the sample's route (None when it does)."""
    if state != "running":
        return f"route lost: sample is {state}"
    if instance != r.instance_id:
        return f"route lost: sample is not routed to instance {r.instance_id}"
    if attempt != r.attempt or token != quoted:
        return "route lost: stale attempt or route token"
    return None


def check_epoch(conn: Connection, run_id: int, epoch: int, holder: str | None = None) -> None:
    """The coordinator fence (ENGINEERING pattern 9): `epoch` (and `holder`, when given) must be
    the run's live leader epoch. FOR SHARE holds off a takeover until this transaction commits."""
    leader = conn.execute(queries.text("check_epoch"), {"run": run_id}).first()
    current = None if leader is None else leader.epoch
    if holder is not None and (leader is None or leader.holder != holder or current != epoch):
        raise Conflict([(epoch, "not the coordinator of this run (leadership lost or expired)")])
    if current != epoch:
        raise Conflict([(epoch, f"coordinator epoch {epoch} is not the run's current leader epoch ({current})")])


# ---- prompt groups -----------------------------------------------------------------------


@dataclass
class Prompt:
    client_key: str
    prompt_tokens: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


def enqueue_prompts(
    conn: Connection, run: RunRow, prompts: Sequence[Prompt], replacement_of: Sequence[int] | None = None
) -> list[int]:
    """Group ids for the prompts, in order (a client key seen before returns its group); with
    `replacement_of`, the groups re-enqueue those filtered groups (keys starting with "~")."""
    check_prompts(run, prompts, replacements=replacement_of is not None)
    payload = json.dumps(
        [
            {
                "o": i,
                "k": p.client_key,
                "t": p.prompt_tokens,
                "m": p.meta,
                "r": replacement_of[i] if replacement_of else None,
            }
            for i, p in enumerate(prompts)
        ]
    )
    created = conn.execute(
        queries.text("enqueue_groups"),
        {"run": run.id, "p": payload, "n": run.samples_per_group},
    ).all()
    log_events(conn, run.id, [Event("group_enqueued", group=gid) for gid, _ in created])
    ids: dict[str, int] = {k: g for g, k in created}
    missing = [p.client_key for p in prompts if p.client_key not in ids]
    if missing:
        ids.update(
            (k, g)
            for g, k in conn.execute(
                queries.text("groups_by_key"),
                {"run": run.id, "keys": missing},
            ).all()
        )
    return [ids[p.client_key] for p in prompts]


def check_prompts(run: RunRow, prompts: Sequence[Prompt], *, replacements: bool) -> None:
    for p in prompts:
        if not p.client_key or len(p.client_key) > 500:
            raise InvalidInput("client_key must have 1..500 characters")
        if not replacements and p.client_key.startswith("~"):
            raise InvalidInput(f"client_key {p.client_key!r}: keys starting with '~' are reserved for replacements")
        if not 1 <= len(p.prompt_tokens) <= run.max_prompt_tokens:
            raise InvalidInput(
                f"prompt {p.client_key!r}: {len(p.prompt_tokens)} tokens (allowed 1..{run.max_prompt_tokens})"
            )
        if any(not isinstance(t, int) or t < 0 or t >= 2**31 for t in p.prompt_tokens):
            raise InvalidInput(f"prompt {p.client_key!r}: token ids must be integers in 0..2^31-1")
    if len({p.client_key for p in prompts}) != len(prompts):
        raise InvalidInput("a client_key appears twice in one batch")


# ---- transactions ------------------------------------------------------------------------


class TxMixin:
    """Transactions and request-id idempotency for the operation classes, all through
    `staleflow_db.idempotency` (the one transaction runner, shared with the API). A caller
    composing several operations in one transaction passes its connection as `conn=`."""

    engine: Engine
    # Times every outermost transaction by operation (`idempotency.transactional`): the API's
    # /metrics sets it.
    observe_transaction: Callable[[str], AbstractContextManager[None]] | None = None

    def __init__(self, engine: Engine):
        self.engine = engine

    def tx(self, conn: Connection | None) -> AbstractContextManager[Connection]:
        """The caller's transaction, else a new one."""
        return idempotency.within(self.engine, conn)

    def statement_tx(self, conn: Connection | None) -> AbstractContextManager[Connection]:
        """The caller's transaction, else a connection whose every statement is its own
        transaction: for an operation whose write is one statement (the statement's atomicity
        is all it needs). No BEGIN and COMMIT round trips."""
        return idempotency.statements(self.engine, conn)

    @contextmanager
    def run_tx(self, run_id: int, conn: Connection | None) -> Iterator[RunTx]:
        with self.tx(conn) as c:
            rtx = RunTx.open(c, run_id)
            yield rtx
            rtx.flush()

    def idempotent(
        self,
        request_id: str | None,
        operation: str,
        run: Callable[[Connection], Any],
        decode: Callable[[Any], Any],
        body: Any = None,
        conn: Connection | None = None,
    ) -> Any:
        """`run` in one transaction with the stored outcome of `request_id` (see
        staleflow_db.idempotency.once): a repeat replays it, another `body` is refused."""
        # the digest only matters with a key; serialising a batch of reports costs real CPU
        digest = idempotency.digest(body) if request_id is not None else ""
        return idempotency.once(self.engine, request_id, operation, digest, run, dumps, decode, conn=conn)[0]
