"""The event log: one named row per protocol transition, appended in batched statements."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text


@dataclass(frozen=True)
class Event:
    kind: str  # e.g. sample_routed, group_occupied, published
    sample: int | None = None
    group: int | None = None
    buffer: int | None = None
    instance: int | None = None
    data: dict[str, Any] | None = None


def log_events(conn: Connection, run_id: int, events: Sequence[Event]) -> None:
    """Append the events to the run's log in one statement."""
    if events:
        conn.execute(text(EVENTS_INSERT.format(p="")), events_params(run_id, events))


# one multi-row INSERT for any number of events; {p} prefixes the parameter names, so that
# RunTx.flush can send it as one part of a larger statement. The data come as one JSON array
# (parsed once: the scalar subquery is an InitPlan) and JSON null is stored as NULL.
EVENTS_INSERT = (
    "INSERT INTO events (run_id, kind, sample_id, group_id, buffer, instance_id, data)"
    " SELECT :{p}run, u.k, u.s, u.g, u.b, u.i, nullif((SELECT CAST(:{p}d AS jsonb)) -> (u.o::int - 1), 'null')"
    " FROM unnest(CAST(:{p}k AS text[]), CAST(:{p}s AS bigint[]), CAST(:{p}g AS bigint[]), CAST(:{p}b AS int[]),"
    " CAST(:{p}i AS bigint[])) WITH ORDINALITY AS u(k, s, g, b, i, o)"
)


def events_params(run_id: int, events: Sequence[Event], prefix: str = "") -> dict[str, Any]:
    return {
        f"{prefix}{k}": v
        for k, v in {
            "run": run_id,
            "k": [e.kind for e in events],
            "s": [e.sample for e in events],
            "g": [e.group for e in events],
            "b": [e.buffer for e in events],
            "i": [e.instance for e in events],
            # one JSON array for all the events' data (a json.dumps per event cost ~3x more)
            "d": json.dumps([e.data for e in events]),
        }.items()
    }
