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
    if not events:
        return
    conn.execute(
        text(
            "INSERT INTO events (run_id, kind, sample_id, group_id, buffer, instance_id, data)"
            " SELECT :run, u.k, u.s, u.g, u.b, u.i, u.d FROM unnest(CAST(:k AS text[]), CAST(:s AS bigint[]),"
            " CAST(:g AS bigint[]), CAST(:b AS int[]), CAST(:i AS bigint[]), CAST(:d AS jsonb[])) AS u(k, s, g, b, i, d)"
        ),
        {
            "run": run_id,
            "k": [e.kind for e in events],
            "s": [e.sample for e in events],
            "g": [e.group for e in events],
            "b": [e.buffer for e in events],
            "i": [e.instance for e in events],
            "d": [None if e.data is None else json.dumps(e.data) for e in events],
        },
    )
